"""Issue 12, item 3: a checkpoint is signed only over a root proven from the stored leaf hashes.

The stored subtree hashes (the frontier) are a cache of what the leaf hashes determine. Before, a
corrupted one was signed as it was, and every export after it failed. Now `checkpoint()` recomputes
the hashes of everything appended since the last signed checkpoint from the leaf hashes (the whole
tree for the first checkpoint) and refuses, naming the entries, when they differ.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvguard.audit import merkle
from kvguard.audit import schema as t
from kvguard.audit.export import consistency_lines
from kvguard.audit.ledger import Ledger
from kvguard.errors import LogRewrittenError, VerificationError

from .conftest import make_event

Opener = Callable[..., Ledger]


def _corrupt_hash(db: Path, level: int, index: int) -> None:
    """What someone with DDL rights (or file access) can do: rewrite one stored subtree hash."""
    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute("DROP TRIGGER ledger_hashes_no_update")
    raw.execute(
        "UPDATE ledger_hashes SET hash = ? WHERE id = ?",
        (b"\x55" * 32, merkle.stored_hash_key(level, index)),
    )
    raw.close()


def _checkpoints(ledger: Ledger) -> list[int]:
    with ledger.store.engine.connect() as conn:
        return list(conn.execute(sa.select(t.checkpoints.c.size)).scalars())


def test_a_corrupted_frontier_after_the_last_checkpoint_is_not_signed(
    tmp_path: Path, open_ledger: Opener
) -> None:
    db = tmp_path / "ledger.db"
    ledger = open_ledger(f"sqlite:///{db}")
    ledger.append_many([make_event(i) for i in range(8)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(8, 16)])
    _corrupt_hash(db, 3, 1)  # the subtree of entries 8..15, appended since the checkpoint
    with pytest.raises(VerificationError, match=r"entries 8\.\.15: .*corrupted frontier"):
        ledger.checkpoint()
    assert _checkpoints(ledger) == [8]  # nothing signed, nothing stored


def test_a_corrupted_frontier_is_not_signed_by_the_first_checkpoint(
    tmp_path: Path, open_ledger: Opener
) -> None:
    db = tmp_path / "ledger.db"
    ledger = open_ledger(f"sqlite:///{db}")
    ledger.append_many([make_event(i) for i in range(12)])
    _corrupt_hash(db, 3, 0)  # entries 0..7, part of the root of 12
    with pytest.raises(VerificationError, match="corrupted frontier"):
        ledger.checkpoint()
    assert _checkpoints(ledger) == []


def test_a_rewritten_prefix_is_not_signed(tmp_path: Path, open_ledger: Opener) -> None:
    """A corrupted hash *inside* the signed prefix contradicts the signed root: refused as a
    rewrite (the consistency proof from the last checkpoint fails)."""
    db = tmp_path / "ledger.db"
    ledger = open_ledger(f"sqlite:///{db}")
    ledger.append_many([make_event(i) for i in range(8)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(8, 12)])
    _corrupt_hash(db, 3, 0)  # entries 0..7, covered by the signed checkpoint
    with pytest.raises(LogRewrittenError, match="no longer extends its checkpoint of size 8"):
        ledger.checkpoint()
    assert _checkpoints(ledger) == [8]


def test_checkpoints_after_clean_appends_still_sign(tmp_path: Path, open_ledger: Opener) -> None:
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    for n in (1, 2, 5, 13, 64, 65, 100):
        ledger.append_many([make_event(i) for i in range(ledger.size, n)])
        ledger.checkpoint()
    assert _checkpoints(ledger) == [1, 2, 5, 13, 64, 65, 100]
    assert ledger.verify().checkpoints == 7


def test_export_checks_each_consistency_proof_before_writing_it(
    tmp_path: Path, open_ledger: Opener
) -> None:
    """Issue 12, item 5: a proof that does not lead to the new root is a rewritten log, reported
    by the exporter, never written for the auditor to read as a fork."""
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.append_many([make_event(i) for i in range(5)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(5, 9)])
    ledger.checkpoint()
    with ledger.store.engine.connect() as conn:
        good = consistency_lines(ledger, conn, 9, ledger.root(9))
        assert len(good) == 1
        with pytest.raises(LogRewrittenError, match="no longer extends its checkpoint of size 5"):
            consistency_lines(ledger, conn, 9, b"\x11" * 32)
