"""Issue 11: commit-ordered commands, the ledger outbox, fast admin key hashes, policy author roles.

- `command_head` and `engine_commands.seq`: commands numbered under one row lock, so their numbers
  follow commit order (0.1.0 commands are numbered by id, which was their order on SQLite).
- `engines.command_seq_start`: the command number an engine starts after.
- `control_outbox`: ledger events committed with their state change.
- `admin_api_keys.secret_hash` (HMAC-SHA256); `secret_scrypt` becomes optional (only 0.1.0 keys).
- `policy_versions.author_role`: whose limits a version sets (NULL on older versions: admin).

Revision ID: 0002_control_contract
Revises: 0001_control_0_1
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_control_contract"
down_revision = "0001_control_0_1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "command_head",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
    )
    op.add_column("engine_commands", sa.Column("seq", sa.BigInteger, nullable=True))
    op.execute("UPDATE engine_commands SET seq = id")
    op.create_index("engine_commands_seq_key", "engine_commands", ["seq"], unique=True)
    op.execute(
        "INSERT INTO command_head (id, seq) SELECT 1, COALESCE(MAX(id), 0) FROM engine_commands"
    )
    op.add_column("engines", sa.Column("command_seq_start", sa.BigInteger, nullable=True))
    op.create_table(
        "control_outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("event", sa.Text, nullable=False),
        sa.Column("ledger_index", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_control_outbox_ledger_index", "control_outbox", ["ledger_index"])
    with op.batch_alter_table("admin_api_keys") as batch:
        batch.add_column(sa.Column("secret_hash", sa.LargeBinary(32), nullable=True))
        batch.alter_column("secret_scrypt", existing_type=sa.LargeBinary(32), nullable=True)
    op.add_column("policy_versions", sa.Column("author_role", sa.String(16), nullable=True))


def downgrade() -> None:
    raise RuntimeError("control migrations are not downgraded: restore a backup instead")
