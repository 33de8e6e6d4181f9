"""Alembic environment for the ledger tables. Run through `kvguard.audit.migrate.upgrade`.

The ledger keeps its own version table (`ledger_alembic_version`) so that other packages sharing the
database can run their own Alembic histories beside it.
"""

from __future__ import annotations

from alembic import context

from kvguard.audit.schema import metadata

VERSION_TABLE = "ledger_alembic_version"
_PG_MIGRATION_LOCK = 0x6B76_6775_6172_6431  # pg advisory lock id: two processes opening at once


def _run() -> None:
    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_name=lambda name, type_, _parent: (
            type_ != "table" or str(name).startswith("ledger_")
        ),
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_MIGRATION_LOCK})")
        context.run_migrations()


_run()
