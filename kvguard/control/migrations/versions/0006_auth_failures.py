"""Failed authentications counted across API processes: `auth_failures`.

The admin API's limit (10 failures in 60 s per client address and per key id, then 429) lived in
each process's memory, so `kvguard serve --workers N` let a guesser have N times the documented
failures answered 401. Each process now also counts failures in this table (written on failures
only: an authenticated request never touches it).

Revision ID: 0006_auth_failures
Revises: 0005_command_listing_indexes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_auth_failures"
down_revision = "0005_command_listing_indexes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "auth_failures",
        sa.Column("subject", sa.String(320), primary_key=True),
        sa.Column("window_start", sa.Double, nullable=False),
        sa.Column("failures", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
