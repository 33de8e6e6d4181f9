"""Indexes for a tenant's purge listing: `GET /v1/purges` of one tenant walked every other tenant's
jobs (no index on the tenant columns), so a small tenant paid for the whole platform's purge history
on every page. Now its session purges (`tenant_id`) and its tenant purges (`selector_value`) are each
read newest first along an index and merged (`kvguard.api.purge_jobs.list_jobs`).

Revision ID: 0005_command_listing_indexes
Revises: 0004_policy_limits_of
"""

from __future__ import annotations

from alembic import op

revision = "0005_command_listing_indexes"
down_revision = "0004_policy_limits_of"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_engine_commands_tenant", "engine_commands", ["tenant_id", "kind", "id"])
    op.create_index(
        "ix_engine_commands_selector",
        "engine_commands",
        ["selector_value", "selector_kind", "kind", "id"],
    )


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
