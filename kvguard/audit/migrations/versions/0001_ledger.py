"""Ledger tables and the append-only triggers (SQLite and PostgreSQL).

Revision ID: 0001_ledger
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_ledger"
down_revision = None
branch_labels = None
depends_on = None

# 64-bit everywhere; on SQLite an INTEGER PRIMARY KEY is the rowid itself (no second index to write).
_ROWID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# Tables whose rows are history: no UPDATE, no DELETE, no TRUNCATE, ever.
_FROZEN = ("ledger_entries", "ledger_entry_blocks", "ledger_hashes", "ledger_checkpoints")


def _tables() -> None:
    op.create_table(
        "ledger_head",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("checkpoint_size", sa.BigInteger, nullable=True),
        sa.CheckConstraint("id = 1", name="ledger_head_single_row"),
        sa.CheckConstraint("size >= 0", name="ledger_head_size_nonnegative"),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("idx", _ROWID, primary_key=True, autoincrement=False),
        sa.Column("leaf", sa.LargeBinary, nullable=False),
        sa.Column("leaf_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("scope_tag", sa.String(128), nullable=True),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("ts_us", sa.BigInteger, nullable=False),
    )
    op.create_index("ledger_entries_scope_idx", "ledger_entries", ["scope_tag", "idx"])
    op.create_index("ledger_entries_ts_idx", "ledger_entries", ["ts_us"])
    op.create_index("ledger_entries_request_idx", "ledger_entries", ["request_id"])
    op.create_table(
        "ledger_entry_blocks",
        sa.Column("block_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "ledger_hashes",
        sa.Column("id", _ROWID, primary_key=True, autoincrement=False),
        sa.Column("hash", sa.LargeBinary(32), nullable=False),
    )
    op.create_table(
        "ledger_checkpoints",
        sa.Column("size", _ROWID, primary_key=True, autoincrement=False),
        sa.Column("root", sa.LargeBinary(32), nullable=False),
        sa.Column("note", sa.Text, nullable=False),
        sa.Column("prev_size", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "ledger_payloads",
        sa.Column("idx", _ROWID, primary_key=True, autoincrement=False),
        sa.Column("salt", sa.LargeBinary(32), nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    op.execute("INSERT INTO ledger_head (id, size) VALUES (1, 0)")


def _sqlite_triggers() -> None:
    def trigger(name: str, when: str, table: str, guard: str = "") -> None:
        op.execute(
            f"CREATE TRIGGER {name} BEFORE {when} ON {table} {guard} BEGIN "
            f"SELECT RAISE(ABORT, 'kvguard ledger: {when} on {table} is forbidden'); END"
        )

    for table in _FROZEN:
        trigger(f"{table}_no_update", "UPDATE", table)
        trigger(f"{table}_no_delete", "DELETE", table)
    trigger("ledger_head_no_delete", "DELETE", "ledger_head")
    trigger(
        "ledger_head_no_shrink",
        "UPDATE",
        "ledger_head",
        "FOR EACH ROW WHEN NEW.size < OLD.size OR NEW.id <> OLD.id "
        "OR COALESCE(NEW.checkpoint_size, -1) < COALESCE(OLD.checkpoint_size, -1)",
    )
    trigger("ledger_payloads_no_update", "UPDATE", "ledger_payloads")


_PG_FORBID = """
CREATE OR REPLACE FUNCTION ledger_forbid() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'kvguard ledger: % on % is forbidden', TG_OP, TG_TABLE_NAME
    USING ERRCODE = 'integrity_constraint_violation';
END $$
"""
_PG_HEAD_GUARD = """
CREATE OR REPLACE FUNCTION ledger_head_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'UPDATE' OR NEW.size < OLD.size OR NEW.id <> OLD.id
     OR COALESCE(NEW.checkpoint_size, -1) < COALESCE(OLD.checkpoint_size, -1) THEN
    RAISE EXCEPTION 'kvguard ledger: % on ledger_head may only grow the log', TG_OP
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END $$
"""


def _pg_trigger(name: str, table: str, spec: str, function: str) -> None:
    op.execute(f"CREATE TRIGGER {name} {spec} ON {table} {function}")
    # ENABLE ALWAYS: the trigger fires even under session_replication_role = replica.
    op.execute(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {name}")


def _pg_triggers() -> None:
    op.execute(_PG_FORBID)
    op.execute(_PG_HEAD_GUARD)
    row, stmt = "FOR EACH ROW EXECUTE FUNCTION", "FOR EACH STATEMENT EXECUTE FUNCTION"
    for table in _FROZEN:
        _pg_trigger(
            f"{table}_append_only", table, "BEFORE UPDATE OR DELETE", f"{row} ledger_forbid()"
        )
        _pg_trigger(f"{table}_no_truncate", table, "BEFORE TRUNCATE", f"{stmt} ledger_forbid()")
    _pg_trigger(
        "ledger_head_grow_only",
        "ledger_head",
        "BEFORE UPDATE OR DELETE",
        f"{row} ledger_head_guard()",
    )
    _pg_trigger(
        "ledger_head_no_truncate", "ledger_head", "BEFORE TRUNCATE", f"{stmt} ledger_forbid()"
    )
    _pg_trigger(
        "ledger_payloads_no_update", "ledger_payloads", "BEFORE UPDATE", f"{row} ledger_forbid()"
    )
    _pg_trigger(
        "ledger_payloads_no_truncate",
        "ledger_payloads",
        "BEFORE TRUNCATE",
        f"{stmt} ledger_forbid()",
    )


def upgrade() -> None:
    _tables()
    if op.get_bind().dialect.name == "postgresql":
        _pg_triggers()
    else:
        _sqlite_triggers()


def downgrade() -> None:
    raise RuntimeError("the audit ledger is append-only: its schema is never downgraded")
