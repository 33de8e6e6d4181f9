"""The ledger's SQL tables (SQLAlchemy Core, its own MetaData, every name prefixed `ledger_`).

Other kvguard packages share the database URL with their own tables, so nothing here is unprefixed.
The live schema is created and upgraded by the Alembic migrations in `kvguard/audit/migrations/`
(a test checks that they produce exactly these tables).

- `ledger_head`: the single row holding the tree size and the size of the latest checkpoint. Every
  append locks it, which makes indices gapless without a sequence (sequences skip values on
  rollback).
- `ledger_entries`: one row per leaf: the exact leaf bytes, its RFC 6962 leaf hash (the level-0
  stored hash) and copies of the queryable fields (`verify()` checks every copy against the leaf).
- `ledger_entry_blocks`: (block id, index) pairs for block-id queries.
- `ledger_hashes`: the hash of every *complete* subtree of 2 or more leaves, keyed by
  `hash_key(level, index)`; any root or proof needs O(log n) of them (the sumdb `StoredHashIndex`
  idea with a simpler key). Level 0 lives in `ledger_entries.leaf_hash`, one row fewer per entry.
- `ledger_checkpoints`: the first signed checkpoint issued at each tree size (keyed by size), each
  naming the size of the one before (`prev_size`): with the head's `checkpoint_size`, deleting any
  checkpoint row breaks the chain.
- `ledger_payloads`: erasable personal detail and the salt of its commitment (deletable, never
  updatable).
"""

from __future__ import annotations

import sqlalchemy as sa

from kvguard.audit import merkle

metadata = sa.MetaData()

# 64-bit everywhere; on SQLite an INTEGER PRIMARY KEY is the rowid itself (no second index to write).
_ROWID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

head = sa.Table(
    "ledger_head",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("checkpoint_size", sa.BigInteger, nullable=True),
    sa.CheckConstraint("id = 1", name="ledger_head_single_row"),
    sa.CheckConstraint("size >= 0", name="ledger_head_size_nonnegative"),
)

entries = sa.Table(
    "ledger_entries",
    metadata,
    sa.Column("idx", _ROWID, primary_key=True, autoincrement=False),
    sa.Column("leaf", sa.LargeBinary, nullable=False),
    sa.Column("leaf_hash", sa.LargeBinary(32), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("scope_tag", sa.String(128), nullable=True),
    sa.Column("request_id", sa.String(128), nullable=True),
    sa.Column("ts_us", sa.BigInteger, nullable=False),
    sa.Index("ledger_entries_scope_idx", "scope_tag", "idx"),
    sa.Index("ledger_entries_ts_idx", "ts_us"),
    sa.Index("ledger_entries_request_idx", "request_id"),
)

entry_blocks = sa.Table(
    "ledger_entry_blocks",
    metadata,
    sa.Column("block_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("idx", sa.BigInteger, primary_key=True, autoincrement=False),
    sqlite_with_rowid=False,
)

hashes = sa.Table(
    "ledger_hashes",
    metadata,
    sa.Column("id", _ROWID, primary_key=True, autoincrement=False),
    sa.Column("hash", sa.LargeBinary(32), nullable=False),
)

checkpoints = sa.Table(
    "ledger_checkpoints",
    metadata,
    sa.Column("size", _ROWID, primary_key=True, autoincrement=False),
    sa.Column("root", sa.LargeBinary(32), nullable=False),
    sa.Column("note", sa.Text, nullable=False),
    sa.Column("prev_size", sa.BigInteger, nullable=True),
)

payloads = sa.Table(
    "ledger_payloads",
    metadata,
    sa.Column("idx", _ROWID, primary_key=True, autoincrement=False),
    sa.Column("salt", sa.LargeBinary(32), nullable=False),
    sa.Column("body", sa.LargeBinary, nullable=False),
)

APPEND_ONLY_TABLES = (
    "ledger_entries",
    "ledger_entry_blocks",
    "ledger_hashes",
    "ledger_checkpoints",
)


def hash_key(level: int, index: int) -> int:
    """Primary key of the stored hash of complete subtree (level, index) (see `merkle`)."""
    return merkle.stored_hash_key(level, index)
