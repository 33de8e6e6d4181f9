"""The ledger's SQL tables: SQLAlchemy 2.0 typed models (`Mapped[...]`), their own MetaData, every
name prefixed `ledger_`.

Other kvguard packages share the database URL with their own tables, so nothing here is unprefixed.
The live schema is created and upgraded by the Alembic migrations in `kvguard/audit/migrations/`
(a test checks that they produce exactly these tables).

- `ledger_head`: the single row holding the tree size and the size of the latest checkpoint. Every
  append locks it, which makes indices gapless without a sequence (sequences skip values on
  rollback).
- `ledger_entries`: one row per leaf: the exact leaf bytes, its RFC 6962 leaf hash (the level-0
  stored hash) and copies of the queryable fields (`verify()` checks every copy against the leaf),
  indexed by (scope tag, idx), (kind, idx), ts and request id.
- `ledger_entry_blocks`: (block id, index) pairs for block-id queries.
- `ledger_entry_commands`: (command id, index) pairs linking a purge job (an `engine_commands` id)
  to its entries: every engine's `<kind>.purge` entry (`details.command_id`), the `key.shred`
  entries of the offload keys it destroyed (`details.command_id`, issue 15) and the successful
  `admin.action` that requested it (`leaf.command_links` says which). Listing jobs finds a job's
  entries through it in O(its entries) instead of scanning every purge entry (migration
  `0003_entry_commands`, issue 11; `0005_shred_links` for the key shreds).
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

from typing import cast

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvguard.audit import merkle

# 64-bit everywhere; on SQLite an INTEGER PRIMARY KEY is the rowid itself (no second index to write).
_ROWID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class LedgerBase(DeclarativeBase):
    """The ledger's own declarative base: its own MetaData, shared with no other package."""

    metadata = sa.MetaData()


class LedgerHead(LedgerBase):
    __tablename__ = "ledger_head"
    __table_args__ = (
        sa.CheckConstraint("id = 1", name="ledger_head_single_row"),
        sa.CheckConstraint("size >= 0", name="ledger_head_size_nonnegative"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=False)
    size: Mapped[int] = mapped_column(sa.BigInteger)
    checkpoint_size: Mapped[int | None] = mapped_column(sa.BigInteger)


class LedgerEntry(LedgerBase):
    __tablename__ = "ledger_entries"
    __table_args__ = (
        sa.Index("ledger_entries_scope_idx", "scope_tag", "idx"),
        sa.Index("ledger_entries_kind_idx", "kind", "idx"),
        sa.Index("ledger_entries_ts_idx", "ts_us"),
        sa.Index("ledger_entries_request_idx", "request_id"),
    )

    idx: Mapped[int] = mapped_column(_ROWID, primary_key=True, autoincrement=False)
    leaf: Mapped[bytes] = mapped_column(sa.LargeBinary)
    leaf_hash: Mapped[bytes] = mapped_column(sa.LargeBinary(32))
    kind: Mapped[str] = mapped_column(sa.String(32))
    scope_tag: Mapped[str | None] = mapped_column(sa.String(128))
    request_id: Mapped[str | None] = mapped_column(sa.String(128))
    ts_us: Mapped[int] = mapped_column(sa.BigInteger)


class LedgerEntryBlock(LedgerBase):
    __tablename__ = "ledger_entry_blocks"
    __table_args__ = {"sqlite_with_rowid": False}  # noqa: RUF012 - SQLAlchemy's own convention

    block_id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    idx: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)


class LedgerEntryCommand(LedgerBase):
    __tablename__ = "ledger_entry_commands"
    __table_args__ = {"sqlite_with_rowid": False}  # noqa: RUF012 - SQLAlchemy's own convention

    command_id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    idx: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)


class LedgerHash(LedgerBase):
    __tablename__ = "ledger_hashes"

    id: Mapped[int] = mapped_column(_ROWID, primary_key=True, autoincrement=False)
    hash: Mapped[bytes] = mapped_column(sa.LargeBinary(32))


class LedgerCheckpoint(LedgerBase):
    __tablename__ = "ledger_checkpoints"

    size: Mapped[int] = mapped_column(_ROWID, primary_key=True, autoincrement=False)
    root: Mapped[bytes] = mapped_column(sa.LargeBinary(32))
    note: Mapped[str] = mapped_column(sa.Text)
    prev_size: Mapped[int | None] = mapped_column(sa.BigInteger)


class LedgerPayload(LedgerBase):
    __tablename__ = "ledger_payloads"

    idx: Mapped[int] = mapped_column(_ROWID, primary_key=True, autoincrement=False)
    salt: Mapped[bytes] = mapped_column(sa.LargeBinary(32))
    body: Mapped[bytes] = mapped_column(sa.LargeBinary)


metadata = LedgerBase.metadata
# Core handles on the same tables: the bulk and proof paths use SQL expressions, not ORM sessions.
head = cast(sa.Table, LedgerHead.__table__)
entries = cast(sa.Table, LedgerEntry.__table__)
entry_blocks = cast(sa.Table, LedgerEntryBlock.__table__)
entry_commands = cast(sa.Table, LedgerEntryCommand.__table__)
hashes = cast(sa.Table, LedgerHash.__table__)
checkpoints = cast(sa.Table, LedgerCheckpoint.__table__)
payloads = cast(sa.Table, LedgerPayload.__table__)

APPEND_ONLY_TABLES = (
    "ledger_entries",
    "ledger_entry_blocks",
    "ledger_entry_commands",
    "ledger_hashes",
    "ledger_checkpoints",
)


def hash_key(level: int, index: int) -> int:
    """Primary key of the stored hash of complete subtree (level, index) (see `merkle`)."""
    return merkle.stored_hash_key(level, index)
