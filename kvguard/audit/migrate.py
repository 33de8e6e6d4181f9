"""Bring the ledger schema up to date with the packaged Alembic migrations (idempotent)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvguard.audit.db import write_transaction

_SCRIPTS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "ledger_alembic_version"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_SCRIPTS))
    return cfg


def current_revision(engine: sa.Engine) -> str | None:
    """The ledger revision the database is at (None: no ledger tables yet)."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        current = ctx.get_current_revision()
        conn.rollback()
    return current


def is_current(engine: sa.Engine) -> bool:
    """True when the database is already at the newest ledger revision (a cheap read)."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    return current_revision(engine) == head


def upgrade(engine: sa.Engine) -> None:
    """Run pending migrations in one write transaction (serialised across processes).

    SchemaVersionError when the database is at a ledger revision this release does not know (a
    newer release migrated it): alembic would fail with "Can't locate revision"; nothing is ever
    downgraded implicitly."""
    from alembic.util import CommandError  # noqa: PLC0415 - kept inside the one function

    from kvguard.errors import SchemaVersionError  # noqa: PLC0415

    if is_current(engine):
        return
    cfg = alembic_config()
    current, scripts = current_revision(engine), ScriptDirectory.from_config(cfg)
    try:
        known = current is None or scripts.get_revision(current) is not None
    except CommandError:
        known = False
    if not known:
        raise SchemaVersionError(
            f"database schema {current} is newer than this release "
            f"(head {scripts.get_current_head()}): run the release that migrated it"
        )
    try:
        with write_transaction(engine) as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except sa.exc.ProgrammingError as exc:  # the app role, which has no DDL, on an old schema
        raise SchemaVersionError(
            f"database schema {current or '(none)'} is behind this release "
            f"(head {scripts.get_current_head()}) and this role could not migrate it "
            f"({type(exc).__name__}): run `kvguard db migrate` as the owner role"
        ) from exc


def run_env(
    metadata: sa.MetaData,
    *,
    version_table: str,
    lock_id: int,
    include_name: Callable[[str | None, str, Any], bool],
) -> None:
    """The body of an Alembic `env.py` (the ledger's and the control plane's): migrate on the
    connection `upgrade` hands over, with the package's own version table, serialised across
    processes on PostgreSQL by an advisory lock."""
    from alembic import context  # noqa: PLC0415 (only inside a running migration)

    connection = context.config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=version_table,
        include_name=include_name,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({lock_id})")
        context.run_migrations()
