"""Whose limits a policy version sets: `policy_versions.limits_of`.

A tenant_admin may tighten, never loosen, the limits an admin set for its tenant. Before this
column, the limits were the whole latest admin-written version, so an admin's edit of *another*
tenant's entry (or a disable) turned a tenant_admin's own earlier tightening into its limits. Now
each version records whose limits it sets: `*` every tenant's (a whole-set write, a seed), a tenant
id that tenant's only, `-` none (a tenant_admin's). Rows stored before keep NULL (the table is
append-only: its guards refuse updates) and are read by `author_role`, as before. The index makes
"the latest version that set X's limits" one lookup.

Revision ID: 0004_policy_limits_of
Revises: 0003_tenant_offload_stats
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_policy_limits_of"
down_revision = "0003_tenant_offload_stats"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("policy_versions", sa.Column("limits_of", sa.String(256), nullable=True))
    op.create_index("ix_policy_versions_limits_of", "policy_versions", ["limits_of", "version"])


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
