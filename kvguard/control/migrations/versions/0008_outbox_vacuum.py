"""PostgreSQL: vacuum the control outbox after a fixed number of drained rows, not a fraction of it.

Every admin write inserts an outbox row that the drain then stamps with its ledger index, so each
write leaves one dead row version behind, and the drain's pending read (`ledger_index IS NULL`)
walks every dead version still in the index until a vacuum removes them. Autovacuum's default
waits for a fifth of the table to be dead, and the outbox keeps every drained row, so the wait, and
with it the cost of every drain, grew with the control plane's whole history: measured on
`benchmarks/control_load.py` (2026-11-28, a fresh database, no vacuum yet), the pending read went
from 0.14 to 3.7 ms within 15,000 writes, and a year of writes would leave hundreds of thousands of
dead versions between vacuums. With a fixed threshold the dead
versions a drain can meet stay bounded by the threshold plus what one autovacuum interval writes,
whatever the history. Statistics follow the same threshold. SQLite has no vacuum daemon and no
dead versions in its indexes: nothing to do there.

Revision ID: 0008_outbox_vacuum
Revises: 0007_tenant_key_listing
"""

from __future__ import annotations

from alembic import op

revision = "0008_outbox_vacuum"
down_revision = "0007_tenant_key_listing"
branch_labels = None
depends_on = None

# Dead row versions (drained writes) that start an autovacuum of the outbox, and changed rows that
# start an analyze: about a minute of writes at the load benchmark's rate.
OUTBOX_VACUUM_THRESHOLD = 2000


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        "ALTER TABLE control_outbox SET ("
        "autovacuum_vacuum_scale_factor = 0, "
        f"autovacuum_vacuum_threshold = {OUTBOX_VACUUM_THRESHOLD}, "
        "autovacuum_analyze_scale_factor = 0, "
        f"autovacuum_analyze_threshold = {OUTBOX_VACUUM_THRESHOLD})"
    )


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
