"""Outbox drains in several server processes take turns on the ledger's head lock: a drain reads
and prepares the pending rows, then appends, under the lock, only those no other drainer has
delivered meanwhile (`Outbox.drain`). So a drain that returns has delivered every row committed
before it started, and nothing is appended in vain. Before, the drainers raced: the loser's append
rolled back and was redone, and one that lost five times in a row returned with its writers' rows
still pending, so the admin API answered writes whose ledger entries did not exist yet (a load
re-test saw the warning 6-14 times per 40 s run with two server processes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from kvguard.audit import merkle, store
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.audit.store import LedgerStore
from kvguard.control import outbox
from kvguard.control.db import open_engine, write_transaction
from kvguard.control.outbox import Outbox, operator_event
from kvguard.control.schema import OutboxRow
from kvguard.errors import AuditError, VerificationError

ORIGIN = "kvguard.test/outbox"
PROCESSES, THREADS, WRITES = 2, 6, 30


@dataclass
class Process:
    """What one server process holds: its own engine, outbox and ledger (own pools and locks)."""

    engine: sa.Engine
    outbox: Outbox
    ledger: Ledger


@contextmanager
def processes(url: str, key: SigningKey, n: int) -> Iterator[list[Process]]:
    opened = []
    try:
        for _ in range(n):
            engine = open_engine(url)
            ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
            opened.append(Process(engine, Outbox(engine), ledger))
        yield opened
    finally:
        for p in opened:
            p.ledger.close()
            p.engine.dispose()


def test_a_drain_delivers_every_row_committed_before_it_whatever_other_processes_drain(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = SigningKey.generate(ORIGIN)
    inserted: list[int] = []  # rows each append inserted, committed or rolled back
    insert_params = store._insert_params  # every append's rows pass through it

    def counted(first: int, prepared: Any, frontier: Any) -> Any:
        inserted.append(len(prepared))
        return insert_params(first, prepared, frontier)

    monkeypatch.setattr(store, "_insert_params", counted)
    undelivered: list[int] = []  # rows still pending after their own writer's drain returned
    failures: list[BaseException] = []
    with processes(db_url, key, PROCESSES) as procs:

        def writer(p: Process, n: int) -> None:
            try:
                for i in range(WRITES):
                    with write_transaction(p.engine) as conn:
                        (row_id,) = p.outbox.add(conn, [operator_event("test.write", n=n, i=i)])
                    p.outbox.drain(p.ledger)  # what the API waits for before it answers
                    with p.engine.connect() as conn:
                        index = conn.execute(
                            sa.select(OutboxRow.ledger_index).where(OutboxRow.id == row_id)
                        ).scalar_one()
                    if index is None:
                        undelivered.append(row_id)
            except BaseException as exc:  # reported by the main thread
                failures.append(exc)

        threads = [
            threading.Thread(target=writer, args=(procs[t % PROCESSES], t))
            for t in range(PROCESSES * THREADS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert not failures, failures
        assert undelivered == []
        with procs[0].engine.connect() as conn:
            indices = conn.execute(sa.select(OutboxRow.ledger_index)).scalars().all()
        total = PROCESSES * THREADS * WRITES
        assert sorted(i for i in indices if i is not None) == list(
            range(total)
        )  # each row appended once, nothing else
        # No append in vain: drains wait for each other instead of racing for the same rows.
        assert sum(inserted) == total
        ledger = procs[1].ledger
        assert ledger.size == total
        assert ledger.verify().size == total


def test_a_drain_with_nothing_pending_takes_no_lock_and_appends_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = SigningKey.generate(ORIGIN)
    with processes(db_url, key, 1) as (p,):
        with write_transaction(p.engine) as conn:
            p.outbox.add(conn, [operator_event("test.write")])
        assert p.outbox.drain(p.ledger) == 1
        locks: list[int] = []
        append = LedgerStore.append_collected  # the only way to the head lock

        def counted(self: LedgerStore, *args: Any, **kwargs: Any) -> tuple[int, int]:
            locks.append(1)
            return append(self, *args, **kwargs)

        monkeypatch.setattr(LedgerStore, "append_collected", counted)
        assert p.outbox.drain(p.ledger) == 0
        assert locks == []
        assert p.ledger.size == 1
        assert p.outbox.pending() == 0


@contextmanager
def stamped_without_the_lock(
    monkeypatch: pytest.MonkeyPatch, p: Process, row_id: int, index: int
) -> Iterator[None]:
    """PostgreSQL: while inside, a writer that bypasses the ledger's head lock stamps outbox row
    `row_id` with `index` (committed) between a drain's first round trip and its inserts."""
    take = outbox._PendingClaim.take

    def bypassing(self: Any, rows: Any) -> Any:
        with p.engine.connect() as other:
            other.exec_driver_sql(
                f"UPDATE control_outbox SET ledger_index = {index} WHERE id = {row_id}"
            )
            other.commit()
        return take(self, rows)

    monkeypatch.setattr(outbox._PendingClaim, "take", bypassing)
    try:
        yield
    finally:
        monkeypatch.setattr(outbox._PendingClaim, "take", take)


def _queue(p: Process, n: int, what: str = "test.write") -> list[int]:
    with write_transaction(p.engine) as conn:
        return p.outbox.add(conn, [operator_event(what, i=i) for i in range(n)])


def _indices(p: Process) -> dict[int, int | None]:
    with p.engine.connect() as conn:
        return dict(conn.execute(sa.select(OutboxRow.id, OutboxRow.ledger_index)).all())


def test_rows_stamped_by_a_writer_without_the_head_lock_refuse_the_whole_append(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between finding its rows still pending and stamping them, a drain holds the head lock; a
    writer that bypasses it and stamps one of them meanwhile makes the drain append nothing (on
    PostgreSQL the stamp's check fails inside the pipeline, before its COMMIT runs)."""
    key = SigningKey.generate(ORIGIN)
    with processes(db_url, key, 1) as (p,):
        _queue(p, 3, "test.before")
        assert p.outbox.drain(p.ledger) == 3
        ids = _queue(p, 4)
        sneaked = ids[1]
        if p.engine.dialect.name == "postgresql":
            with (
                stamped_without_the_lock(monkeypatch, p, sneaked, 999),
                pytest.raises(AuditError, match="does not hold the ledger's head lock"),
            ):
                p.outbox.drain(p.ledger)
        else:  # one writer at a time on SQLite: the bypassing write runs inside the transaction
            collect = outbox._PendingClaim.collect
            stamp = f"UPDATE control_outbox SET ledger_index = 999 WHERE id = {sneaked}"

            def bypassing_sqlite(self: Any, conn: sa.Connection) -> Any:
                found = collect(self, conn)
                conn.exec_driver_sql(stamp)
                return found

            monkeypatch.setattr(outbox._PendingClaim, "collect", bypassing_sqlite)
            with pytest.raises(AuditError, match="does not hold the ledger's head lock"):
                p.outbox.drain(p.ledger)
            monkeypatch.undo()
        assert p.ledger.size == 3  # nothing appended, the head did not move
        stamped = _indices(p)
        # The drain's own stamps rolled back; on PostgreSQL the bypassing write had committed.
        foreign = 999 if p.engine.dialect.name == "postgresql" else None
        assert [stamped[i] for i in ids] == [None, foreign, None, None]
        left = 4 if foreign is None else 3
        assert p.outbox.drain(p.ledger) == left  # the next drain goes on where the log is
        stamped = _indices(p)
        assert sorted(stamped[i] for i in ids if i != sneaked or foreign is None) == list(
            range(3, 3 + left)
        )
        assert p.ledger.verify().size == 3 + left


def test_drains_of_two_processes_read_each_others_frontier_with_the_lock(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each drain finds the head moved by the other process; PostgreSQL reads the new frontier in
    the lock's own round trip (no `_load_frontier`), SQLite after it, and both logs verify."""
    key = SigningKey.generate(ORIGIN)
    loads: list[int] = []
    load = LedgerStore._load_frontier

    def counted(self: LedgerStore, conn: sa.Connection, size: int) -> merkle.Frontier:
        loads.append(size)
        return load(self, conn, size)

    monkeypatch.setattr(LedgerStore, "_load_frontier", counted)
    with processes(db_url, key, 2) as procs:
        for n in range(1, 40):  # every tree size shape up to 2 * 39 + 39 entries
            p = procs[n % 2]
            _queue(p, n % 5 + 1)
            assert p.outbox.drain(p.ledger) == n % 5 + 1
        size = sum(n % 5 + 1 for n in range(1, 40))
        for p in procs:
            assert p.ledger.verify().size == size
        expected_loads = 0 if procs[0].engine.dialect.name == "postgresql" else 38
        assert len(loads) == expected_loads


def test_a_drain_after_a_foreign_insert_rebuilds_the_subtree_hashes_it_left_out(
    db_url: str,
) -> None:
    """A row inserted at the head by something other than kvguard completes subtrees whose hashes
    nobody stored: the lock's frontier read finds them missing and the drain rebuilds them."""
    key = SigningKey.generate(ORIGIN)
    with processes(db_url, key, 1) as (p,):
        _queue(p, 11)
        assert p.outbox.drain(p.ledger) == 11
        leaf = b"foreign"
        digest = merkle.leaf_hash(leaf)
        with p.engine.begin() as conn:  # entry 11 completes the subtrees of 10..11 and 8..11
            conn.execute(
                sa.text(
                    "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
                    "VALUES (11, :leaf, :hash, 'block.alloc', 0)"
                ),
                {"leaf": leaf, "hash": digest},
            )
        _queue(p, 5)
        assert p.outbox.drain(p.ledger) == 5
        assert p.ledger.size == 17
        with pytest.raises(VerificationError, match="entry 11"):  # named, not stuck
            p.ledger.verify()
        with p.engine.connect() as conn:
            for level, position in ((1, 5), (2, 2)):  # rebuilt, and equal to what the leaves give
                stored = conn.execute(
                    sa.text("SELECT hash FROM ledger_hashes WHERE id = :id"),
                    {"id": merkle.stored_hash_key(level, position)},
                ).scalar_one()
                assert (
                    bytes(stored)
                    == merkle.tree_levels(
                        bytes(h) for h in p.ledger.store.leaf_hashes(conn, 0, 17)
                    )[level][position]
                )
            assert (
                p.ledger.store.root(17, conn)
                == merkle.tree_levels(bytes(h) for h in p.ledger.store.leaf_hashes(conn, 0, 17))[
                    -1
                ][0]
            )


def test_the_frontier_query_keys_subtrees_as_merkle_does() -> None:
    assert "<< 48" in store._PG_FRONTIER_SQL and merkle.LEVEL_SHIFT == 48
    assert "generate_series(0, 47)" in store._PG_FRONTIER_SQL
