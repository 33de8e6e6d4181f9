"""The one engine factory of the control plane, and its migrations.

`open_engine(url)` is what the admin API, the CLI and the engines connect with: the ledger's durability
and locking settings (`kvguard.audit.db`: WAL, `synchronous=FULL` and `BEGIN IMMEDIATE` writers on
SQLite; READ COMMITTED with pre-ping on PostgreSQL), and SQL parameters hidden from exception texts
(a failed statement's tenant or session ids never reach a log or a traceback). Opening runs the
control migrations once per engine (`upgrade`), so a database made by an older release gains the new
columns and tables with its data kept.

A database made by kvguard 0.1.0 has the control tables but no `control_alembic_version`: revision
0001 creates only the tables that are missing, so it applies to such a database as it is.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Final

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError as AlembicCommandError

from kvguard.audit.db import create_engine, read_connection, reading, write_transaction
from kvguard.errors import SchemaVersionError

VERSION_TABLE: Final = "control_alembic_version"
_SCRIPTS: Final = Path(__file__).resolve().parent / "migrations"
_migrated: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_migrated_lock = threading.Lock()

__all__ = [
    "VERSION_TABLE",
    "create_engine",
    "ensure_schema",
    "open_engine",
    "read_connection",
    "reading",
    "upgrade",
    "write_transaction",
]


def open_engine(url: str) -> sa.Engine:
    """An engine for `url` with the control plane's settings, its schema brought up to date."""
    engine = create_engine(url)
    ensure_schema(engine)
    return engine


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_SCRIPTS))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        current = ctx.get_current_revision()
        conn.rollback()
    return current


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    """Run pending control migrations in one write transaction (serialised across processes).

    SchemaVersionError when the database is at a revision this release does not know: one that a
    newer release migrated it to (a rollback, or an older process during a rolling upgrade). Alembic
    would fail with "Can't locate revision"; downgrading is never done implicitly."""
    current, head = current_revision(engine), head_revision()
    if revision == "head" and current == head:
        return
    if current is not None and not _known(current):
        raise SchemaVersionError(
            f"database schema {current} is newer than this release (head {head}): "
            "run the release that migrated it"
        )
    cfg = alembic_config()
    try:
        with write_transaction(engine) as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    except sa.exc.ProgrammingError as exc:
        # Almost always the app role (no DDL, docs/operations.md) on a database its owner has not
        # migrated for this release yet: say so, instead of a bare "ProgrammingError".
        raise SchemaVersionError(
            f"database schema {current or '(none)'} is behind this release (head {head}) and "
            f"this role could not migrate it ({type(exc).__name__}): run `kvguard db migrate` "
            "as the owner role"
        ) from exc


def _known(revision: str) -> bool:
    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except AlembicCommandError:  # alembic's "Can't locate revision" (and its ResolutionError)
        return False


def ensure_schema(engine: sa.Engine) -> None:
    """`upgrade` once per engine object (stores built on an engine call this; it is cheap after)."""
    with _migrated_lock:
        if engine in _migrated:
            return
    upgrade(engine)
    with _migrated_lock:
        _migrated.add(engine)
