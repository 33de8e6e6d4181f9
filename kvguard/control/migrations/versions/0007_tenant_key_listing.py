"""An index for a tenant's inference-key listing: `GET /v1/tenants/{id}/inference-keys` returned
every key the tenant ever had in one answer. It is paged now (`after`, `limit`), newest first,
along this index (`kvguard.control.keys.TenantKeys.list`).

Revision ID: 0007_tenant_key_listing
Revises: 0006_auth_failures
"""

from __future__ import annotations

from alembic import op

revision = "0007_tenant_key_listing"
down_revision = "0006_auth_failures"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_tenant_api_keys_listing", "tenant_api_keys", ["tenant_id", "created_at", "key_id"]
    )


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
