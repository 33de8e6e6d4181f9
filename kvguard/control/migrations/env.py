"""Alembic environment for the control tables. Run through `kvguard.control.db.upgrade`.

The control plane keeps its own version table (`control_alembic_version`) beside the ledger's.
"""

from __future__ import annotations

from alembic import context

from kvguard.control.db import VERSION_TABLE
from kvguard.control.schema import metadata

_PG_MIGRATION_LOCK = 0x6B76_6775_6172_6432  # pg advisory lock id: two processes opening at once


def _run() -> None:
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_name=lambda name, type_, _parent: type_ != "table" or name in metadata.tables,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
        context.run_migrations()


_run()
