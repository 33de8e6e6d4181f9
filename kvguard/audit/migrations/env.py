"""Alembic environment for the ledger tables. Run through `kvguard.audit.migrate.upgrade`.

The ledger keeps its own version table (`ledger_alembic_version`) so that other packages sharing the
database can run their own Alembic histories beside it.
"""

from __future__ import annotations

from kvguard.audit.migrate import VERSION_TABLE, run_env
from kvguard.audit.schema import metadata

run_env(
    metadata,
    version_table=VERSION_TABLE,
    lock_id=0x6B76_6775_6172_6431,  # pg advisory lock id: two processes opening at once
    include_name=lambda name, type_, _parent: type_ != "table" or str(name).startswith("ledger_"),
)
