"""Issue 15: per-tenant offload tier figures in `engine_tenant_stats`.

Spilled blocks and bytes, restored blocks and prompt tokens served from the tier, per engine and
tenant, for the `kvguard_tenant_offload_*` metrics. Existing rows start at 0.

Revision ID: 0003_tenant_offload_stats
Revises: 0002_control_contract
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_tenant_offload_stats"
down_revision = "0002_control_contract"
branch_labels = None
depends_on = None

COLUMNS = ("tier_spilled_blocks", "tier_spilled_bytes", "tier_restored_blocks", "tier_hit_tokens")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column(
            "engine_tenant_stats",
            sa.Column(name, sa.BigInteger, nullable=False, server_default="0"),
        )


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
