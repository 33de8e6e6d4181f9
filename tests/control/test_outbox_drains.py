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

from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.audit.store import LedgerStore
from kvguard.control.db import open_engine, write_transaction
from kvguard.control.outbox import Outbox, operator_event
from kvguard.control.schema import OutboxRow

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
    insert = LedgerStore._insert

    def counted(self: LedgerStore, conn: sa.Connection, first: int, prepared: Any, f: Any) -> None:
        inserted.append(len(prepared))
        insert(self, conn, first, prepared, f)

    monkeypatch.setattr(LedgerStore, "_insert", counted)
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
        lock_head = LedgerStore.lock_head

        def counted(self: LedgerStore, conn: sa.Connection) -> int:
            locks.append(1)
            return lock_head(self, conn)

        monkeypatch.setattr(LedgerStore, "lock_head", counted)
        assert p.outbox.drain(p.ledger) == 0
        assert locks == []
        assert p.ledger.size == 1
        assert p.outbox.pending() == 0
