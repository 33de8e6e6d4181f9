"""The control tables as kvguard 0.1.0 made them (with `create_all`, one MetaData per package).

Creates only the tables that are missing, so it applies both to an empty database and to a database
made by 0.1.0, which has (some of) these tables but no version table. Frozen: later changes are new
revisions.

Revision ID: 0001_control_0_1
Revises:
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from kvguard.control.schema import POLICY_HEAD_GUARDS, POLICY_VERSION_GUARDS

revision = "0001_control_0_1"
down_revision = None
branch_labels = None
depends_on = None


def _tables() -> dict[str, list[Any]]:
    return {
        "tenants": [
            sa.Column("tenant_id", sa.String(128), primary_key=True),
            sa.Column("display_name", sa.String(256), nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
            sa.Column("created_by", sa.String(128), nullable=False),
            sa.Column("disabled_at", sa.Float, nullable=True),
            sa.Column("disabled_by", sa.String(128), nullable=True),
            sa.Column("disable_reason", sa.String(500), nullable=True),
        ],
        "admin_api_keys": [
            sa.Column("key_id", sa.String(12), primary_key=True),
            sa.Column("salt", sa.LargeBinary(16), nullable=False),
            sa.Column("secret_scrypt", sa.LargeBinary(32), nullable=False),
            sa.Column("role", sa.String(16), nullable=False),
            sa.Column("tenant_id", sa.String(128), nullable=True),
            sa.Column("label", sa.String(200), nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
            sa.Column("revoked_at", sa.Float, nullable=True),
        ],
        "tenant_api_keys": [
            sa.Column("key_id", sa.String(12), primary_key=True),
            sa.Column("secret_sha256", sa.LargeBinary(32), nullable=False),
            sa.Column("tenant_id", sa.String(256), nullable=False, index=True),
            sa.Column("created_at", sa.Float, nullable=False),
            sa.Column("revoked", sa.Boolean, nullable=False),
        ],
        "policy_head": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("version", sa.BigInteger, nullable=False),
        ],
        "policy_versions": [
            sa.Column("version", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("created_at", sa.Double, nullable=False),
            sa.Column("author", sa.String(256), nullable=False),
            sa.Column("reason", sa.String(2000), nullable=False),
            sa.Column("digest", sa.String(71), nullable=False),
            sa.Column("document", sa.Text, nullable=False),
        ],
        "engines": [
            sa.Column("engine_id", sa.String(64), primary_key=True),
            sa.Column("model", sa.String(512), nullable=False),
            sa.Column("block_size", sa.Integer, nullable=False),
            sa.Column("num_blocks", sa.BigInteger, nullable=False),
            sa.Column("started_at", sa.Double, nullable=False),
            sa.Column("last_seen", sa.Double, nullable=False),
            sa.Column("stats_at", sa.Double, nullable=True),
            sa.Column("stopped_at", sa.Double, nullable=True),
            sa.Column("totals", sa.Text, nullable=False),
        ],
        "engine_tenant_stats": [
            sa.Column("engine_id", sa.String(64), primary_key=True),
            sa.Column("tenant_id", sa.String(256), primary_key=True, index=True),
            sa.Column("tenant_tag", sa.String(64), nullable=False),
            *(
                sa.Column(name, sa.BigInteger, nullable=False)
                for name in (
                    "blocks_active",
                    "blocks_cached",
                    "blocks_quarantined",
                    "prefix_hit_tokens",
                    "prompt_tokens",
                    "blocks_zeroized",
                    "bytes_zeroized",
                )
            ),
            sa.Column("oldest_cached_at", sa.Double, nullable=True),
            sa.Column("updated_at", sa.Double, nullable=False),
        ],
        "scope_tags": [
            sa.Column("scope_tag", sa.String(64), primary_key=True),
            sa.Column("tenant_id", sa.String(256), nullable=False, index=True),
            sa.Column("first_seen", sa.Double, nullable=False),
        ],
        "engine_commands": [
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("kind", sa.String(32), nullable=False),
            sa.Column("selector_kind", sa.String(16), nullable=False),
            sa.Column("selector_value", sa.String(256), nullable=False),
            sa.Column("tenant_id", sa.String(256), nullable=True),
            sa.Column("requested_by", sa.String(256), nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
        ],
        "engine_command_acks": [
            sa.Column(
                "command_id", sa.Integer, sa.ForeignKey("engine_commands.id"), primary_key=True
            ),
            sa.Column("engine_id", sa.String(64), primary_key=True),
            sa.Column("done_at", sa.Float, nullable=False),
            sa.Column("result", sa.Text, nullable=False),
        ],
    }


def upgrade() -> None:
    bind = op.get_bind()
    existing = set(sa.inspect(bind).get_table_names())
    for name, columns in _tables().items():
        if name in existing:
            continue
        op.create_table(name, *columns)
        guards = {"policy_versions": POLICY_VERSION_GUARDS, "policy_head": POLICY_HEAD_GUARDS}
        for dialect, statement in guards.get(name, []):
            if dialect == bind.dialect.name:
                op.execute(statement)
    if "policy_head" not in existing:
        op.execute("INSERT INTO policy_head (id, version) VALUES (1, 0)")


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
