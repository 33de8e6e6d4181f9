"""Command links: (command id, index) pairs that find a purge job's ledger entries by its id.

Listing purge jobs looked each job's entries up by scanning every purge entry since the job's
creation and every `admin.action` entry around it: `GET /v1/purges?limit=100` took 18 s on a busy
ledger (issue 11, item 7). With this table a job's purge entries and its request entry are one
primary-key range read. Like `ledger_entry_blocks` it is derived from the leaves, append-only
(triggers), and filled in the transaction that appends the entry (`LedgerStore._insert`).

The upgrade backfills the links of the entries already stored, with the append path's own rule
(`kvguard.audit.leaf.command_links`) applied to each stored leaf, so that an upgraded database finds
old jobs' evidence exactly as before. It reads only the purge and `admin.action` entries, through
the `(kind, idx)` index of 0002, a page at a time.

On PostgreSQL the new table gets the privileges that `ledger_entry_blocks` has (the same kind of
table): an app role granted with `kvguard.audit.roles.app_role_grants` before the upgrade can still
append after it.

Revision ID: 0003_entry_commands
Revises: 0002_kind_index
"""

from __future__ import annotations

import json
from typing import Any, Final

import sqlalchemy as sa
from alembic import op

from kvguard.audit.erasure import PURGE_KINDS
from kvguard.audit.leaf import command_links

revision = "0003_entry_commands"
down_revision = "0002_kind_index"
branch_labels = None
depends_on = None

_TABLE: Final = "ledger_entry_commands"
_TWIN: Final = "ledger_entry_blocks"  # whose privileges the new table copies (PostgreSQL)
_KINDS: Final = (*PURGE_KINDS, "admin.action")
_PAGE: Final = 1_000

_entries = sa.table(
    "ledger_entries",
    sa.column("idx", sa.BigInteger),
    sa.column("kind", sa.String),
    sa.column("leaf", sa.LargeBinary),
)
_links = sa.table(_TABLE, sa.column("command_id", sa.BigInteger), sa.column("idx", sa.BigInteger))


def _create() -> None:
    op.create_table(
        _TABLE,
        sa.Column("command_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sqlite_with_rowid=False,
    )


def _backfill(conn: sa.Connection) -> None:
    """Link every stored purge and purge-request entry: per kind, a walk of the `(kind, idx)`
    index in index order, a page at a time (one kind per walk keeps each page a range read)."""
    for kind in _KINDS:
        stmt = (
            sa.select(_entries.c.idx, _entries.c.leaf)
            .where(_entries.c.kind == kind)
            .order_by(_entries.c.idx)
            .limit(_PAGE)
        )
        after = -1
        while True:
            rows = conn.execute(stmt.where(_entries.c.idx > after)).all()
            links = [{"command_id": c, "idx": int(i)} for i, leaf in rows for c in _links_of(leaf)]
            if links:
                conn.execute(sa.insert(_links), links)
            if len(rows) < _PAGE:
                break
            after = int(rows[-1][0])


def _links_of(leaf: bytes) -> tuple[int, ...]:
    obj: Any = json.loads(bytes(leaf))
    details = obj.get("details") if isinstance(obj, dict) else None
    if not isinstance(details, dict):
        return ()
    return command_links(str(obj.get("kind")), details)


def _sqlite_triggers() -> None:
    for when in ("UPDATE", "DELETE"):
        op.execute(
            f"CREATE TRIGGER {_TABLE}_no_{when.lower()} BEFORE {when} ON {_TABLE} BEGIN "
            f"SELECT RAISE(ABORT, 'kvguard ledger: {when} on {_TABLE} is forbidden'); END"
        )


def _pg_triggers() -> None:
    """The triggers of 0001's frozen tables, on `ledger_forbid()` (created by 0001)."""
    for name, spec in (
        (f"{_TABLE}_append_only", "BEFORE UPDATE OR DELETE ON {t} FOR EACH ROW"),
        (f"{_TABLE}_no_truncate", "BEFORE TRUNCATE ON {t} FOR EACH STATEMENT"),
    ):
        op.execute(
            f"CREATE TRIGGER {name} {spec.format(t=_TABLE)} EXECUTE FUNCTION ledger_forbid()"
        )
        # ENABLE ALWAYS: the trigger fires even under session_replication_role = replica.
        op.execute(f"ALTER TABLE {_TABLE} ENABLE ALWAYS TRIGGER {name}")


def _pg_copy_privileges(conn: sa.Connection) -> None:
    """Grant on the new table what `ledger_entry_blocks` grants (to roles other than its owner)."""
    rows = conn.execute(
        sa.text(
            "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END, "
            "a.privilege_type FROM pg_class c, aclexplode(c.relacl) a "
            "WHERE c.oid = CAST(:twin AS regclass) AND a.grantee <> c.relowner ORDER BY 1, 2"
        ),
        {"twin": _TWIN},
    ).all()
    for grantee, privilege in rows:  # regrole::text quotes names that need it
        op.execute(f"GRANT {privilege} ON {_TABLE} TO {grantee}")


def upgrade() -> None:
    conn = op.get_bind()
    _create()
    _backfill(conn)
    if conn.dialect.name == "postgresql":
        _pg_triggers()
        _pg_copy_privileges(conn)
    else:
        _sqlite_triggers()


def downgrade() -> None:
    raise RuntimeError("the audit ledger is append-only: its schema is never downgraded")
