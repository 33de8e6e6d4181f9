"""Alembic environment for the control tables. Run through `kvguard.control.db.upgrade`.

The control plane keeps its own version table (`control_alembic_version`) beside the ledger's.
"""

from __future__ import annotations

from kvguard.audit.migrate import run_env
from kvguard.control.db import VERSION_TABLE
from kvguard.control.schema import metadata

run_env(
    metadata,
    version_table=VERSION_TABLE,
    lock_id=0x6B76_6775_6172_6432,  # pg advisory lock id: two processes opening at once
    include_name=lambda name, type_, _parent: type_ != "table" or name in metadata.tables,
)
