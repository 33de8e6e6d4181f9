"""Command links of `key.shred` entries: a purge job's offload key shreds found by its id.

Issue 15. An engine with an offload tier destroys the data key of every reuse domain a purge
selects and records a `key.shred` entry naming the job (`details.command_id`); an erasure
certificate needs those entries as it needs the purge entries (`kvguard.audit.erasure`). The append
path now links them in `ledger_entry_commands` (`kvguard.audit.leaf.command_links`), so
`kvguard.audit.erasure_query` reads them with the job's other entries in one range read.

The upgrade links the `key.shred` entries already stored, with the append path's own rule applied
to each stored leaf (as 0003 did for purge and request entries), so that `verify()`, which checks
every entry's links against that rule, still agrees with a database appended to before this
revision. It reads only `key.shred` entries, through the `(kind, idx)` index of 0002, a page at a
time, and skips links that are already there. No schema change: the table, its triggers and its
privileges are 0003's and 0004's.

Revision ID: 0005_shred_links
Revises: 0004_append_guards
"""

from __future__ import annotations

import json
from typing import Any, Final

import sqlalchemy as sa
from alembic import op

from kvguard.audit.erasure import SHRED_KIND
from kvguard.audit.leaf import command_links

revision = "0005_shred_links"
down_revision = "0004_append_guards"
branch_labels = None
depends_on = None

_PAGE: Final = 1_000

_entries = sa.table(
    "ledger_entries",
    sa.column("idx", sa.BigInteger),
    sa.column("kind", sa.String),
    sa.column("leaf", sa.LargeBinary),
)
_links = sa.table(
    "ledger_entry_commands", sa.column("command_id", sa.BigInteger), sa.column("idx", sa.BigInteger)
)


def _links_of(leaf: bytes) -> tuple[int, ...]:
    obj: Any = json.loads(bytes(leaf))
    details = obj.get("details") if isinstance(obj, dict) else None
    if not isinstance(details, dict):
        return ()
    return command_links(str(obj.get("kind")), details)


def upgrade() -> None:
    conn = op.get_bind()
    stmt = (
        sa.select(_entries.c.idx, _entries.c.leaf)
        .where(_entries.c.kind == SHRED_KIND)
        .order_by(_entries.c.idx)
        .limit(_PAGE)
    )
    after = -1
    while True:
        rows = conn.execute(stmt.where(_entries.c.idx > after)).all()
        if not rows:
            break
        found = {(c, int(i)) for i, leaf in rows for c in _links_of(leaf)}
        if found:
            there = sa.select(_links.c.command_id, _links.c.idx).where(
                _links.c.idx.in_(sorted({i for _, i in found}))
            )
            found -= {(int(c), int(i)) for c, i in conn.execute(there)}
        if found:
            conn.execute(sa.insert(_links), [{"command_id": c, "idx": i} for c, i in sorted(found)])
        if len(rows) < _PAGE:
            break
        after = int(rows[-1][0])


def downgrade() -> None:
    raise RuntimeError("the audit ledger is append-only: its schema is never downgraded")
