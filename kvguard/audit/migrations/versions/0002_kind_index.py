"""An index on (kind, idx) for kind-filtered queries.

Without it a page of a rare kind (`policy.change`, `admin.action`) walked the whole table in index
order: 160 ms at 1,000,000 entries on the 2-core benchmark VM, 0.01-0.07 ms with it
(docs/benchmarks.md, "Admin API: audit queries"). `idx` is its second column so that a page is a
range walk in `idx` order, like `ledger_entries_scope_idx`.

Revision ID: 0002_kind_index
Revises: 0001_ledger
"""

from __future__ import annotations

from alembic import op

revision = "0002_kind_index"
down_revision = "0001_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ledger_entries_kind_idx", "ledger_entries", ["kind", "idx"])


def downgrade() -> None:
    raise RuntimeError("the audit ledger is append-only: its schema is never downgraded")
