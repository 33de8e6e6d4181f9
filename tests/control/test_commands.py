"""Engine commands through the database: purge and policy kinds, NOTIFY on PostgreSQL, the listener."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from kvguard.control.commands import (
    CommandListener,
    CommandQueue,
    PolicyCommand,
    PurgeCommand,
    PurgeKind,
    PurgeSelector,
    SkippedCommand,
)
from kvguard.control.db import write_transaction
from kvguard.errors import ConfigError


def test_purge_and_policy_commands_come_back_in_order(db_url) -> None:
    queue = CommandQueue.open(db_url)
    first = queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
    second = queue.submit_policy(7, requested_by="t")
    third = queue.submit_purge(
        PurgeSelector(PurgeKind.SESSION, "s1", tenant_id="acme"), requested_by="t"
    )
    commands = queue.pending_after(0)
    assert [type(c) for c in commands] == [PurgeCommand, PolicyCommand, PurgeCommand]
    assert [c.id for c in commands] == [first, second, third]
    assert commands[1] == PolicyCommand(second, 7, commands[1].seq)
    assert [c.seq for c in commands] == [1, 2, 3]  # gapless, in commit order
    assert commands[2].selector == PurgeSelector(PurgeKind.SESSION, "s1", "acme")
    assert queue.pending_after(commands[1].seq) == [commands[2]]
    assert queue.latest_seq() == 3
    queue.acknowledge(second, "e1", {"policy_version": 7})
    assert queue.acks(second)[0]["policy_version"] == 7
    for bad in (0, -1, True, "3"):
        with pytest.raises(ConfigError, match="policy version"):
            queue.submit_policy(bad, requested_by="t")  # type: ignore[arg-type]
    queue.engine.dispose()


def test_rows_this_version_cannot_read_come_back_as_skipped(db_url) -> None:
    """A newer control plane's command kind, or a purge selector this version does not know, is a
    `SkippedCommand` with its number: an engine steps past it (neither running nor acknowledging
    it) instead of stopping at it or waking for it for ever."""
    queue = CommandQueue.open(db_url)
    newer = {"selector_value": "v", "tenant_id": None, "requested_by": "newer-control-plane"}
    future = queue._submit(None, kind="future", selector_kind="x", **newer)
    odd = queue._submit(None, kind="purge", selector_kind="galaxy", **newer)
    purge = queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
    commands = queue.pending_after(0)
    assert commands[:2] == [SkippedCommand(future, "future", 1), SkippedCommand(odd, "purge", 2)]
    assert commands[2] == PurgeCommand(purge, PurgeSelector(PurgeKind.TENANT, "acme"), 3)
    queue.engine.dispose()


def test_listener_refuses_sqlite(sqlite_url) -> None:
    with pytest.raises(ConfigError, match="PostgreSQL"):
        CommandListener(sa.create_engine(sqlite_url))


@pytest.mark.postgres
def test_notify_wakes_the_listener_and_close_is_prompt(pg_url) -> None:
    queue = CommandQueue.open(pg_url)
    listener = CommandListener.open(pg_url).start()
    try:
        assert listener.wait_listening(10.0)
        listener.take()  # the flag raised when LISTEN began
        assert not listener.wait(0.7)  # nothing submitted: no wake-up
        queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
        assert listener.wait(5.0)
        assert listener.take() and not listener.take()  # one flag, cleared by take()
        queue.submit_policy(3, requested_by="t")
        assert listener.wait(5.0)
    finally:
        started = time.monotonic()
        listener.close()
        assert time.monotonic() - started < 2.0
        assert not listener.alive
        queue.engine.dispose()


def test_a_notification_ticks_at_once_and_hurry_ticks_faster(db_url) -> None:
    """The engine link fetches commands in the listener's tick: on PostgreSQL a notification runs
    it at once (not after the half-second wait); `hurry` makes it tick every 50 ms for a while (the
    acknowledgements of commands just fetched)."""
    ticks: list[float] = []
    queue = CommandQueue.open(db_url)
    listener = CommandListener(queue.engine, tick=lambda: ticks.append(time.monotonic())).start()
    try:
        if queue.engine.dialect.name == "postgresql":
            assert listener.wait_listening(10.0)
            time.sleep(0.2)
            before = len(ticks)
            submitted = time.monotonic()
            queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
            deadline = time.monotonic() + 5
            while len(ticks) == before and time.monotonic() < deadline:
                time.sleep(0.005)
            assert ticks[before] - submitted < 0.3  # not the half-second wait out
        time.sleep(0.6)
        start = len(ticks)
        time.sleep(1.0)
        slow = len(ticks) - start
        listener.hurry(1.0)
        start = len(ticks)
        time.sleep(1.0)
        fast = len(ticks) - start
        assert slow <= 3 and fast >= 8, (slow, fast)
    finally:
        listener.close()
        queue.engine.dispose()


def _listening_pids(engine: sa.Engine) -> set[int]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN kvguard%' AND datname = current_database()"
                )
            ).scalars()
        )


@pytest.mark.postgres
def test_listener_reconnects_after_its_connection_is_killed(pg_url) -> None:
    queue = CommandQueue.open(pg_url)
    listener = CommandListener.open(pg_url).start()
    try:
        assert listener.wait_listening(10.0)
        (old,) = _listening_pids(queue.engine)
        with queue.engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": old})
        deadline = time.monotonic() + 15
        while not (_listening_pids(queue.engine) - {old}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening_pids(queue.engine) - {old}, "the listener did not listen again"
        time.sleep(0.2)
        listener.take()  # the flag raised on reconnecting
        queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
        assert listener.wait(5.0)
    finally:
        listener.close()
        queue.engine.dispose()


@pytest.mark.postgres
def test_a_command_committed_after_a_higher_id_was_read_is_not_skipped(pg_url) -> None:
    """The 0.1.0 bug: ids are drawn before commit, so an `id > last` cursor skipped a command that
    committed late. Numbers are taken in commit order: the reader sees the late one."""
    queue = CommandQueue.open(pg_url)
    slow_started, release = threading.Event(), threading.Event()

    def slow_submit() -> None:
        with write_transaction(queue.engine) as conn:
            queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "slow"), requested_by="t", conn=conn)
            slow_started.set()
            release.wait(10)  # commit only after the fast one had its chance

    slow = threading.Thread(target=slow_submit)
    slow.start()
    assert slow_started.wait(10)
    fast_done = threading.Event()
    fast = threading.Thread(
        target=lambda: (
            queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "fast"), requested_by="t"),
            fast_done.set(),
        )
    )
    fast.start()
    # The fast submitter waits for the head lock: it cannot commit a number before the slow one.
    assert not fast_done.wait(0.5)
    assert queue.pending_after(0) == []
    release.set()
    slow.join(10)
    fast.join(10)
    seen = [c.selector.value for c in queue.pending_after(0) if isinstance(c, PurgeCommand)]
    assert seen == ["slow", "fast"]
    queue.engine.dispose()


@pytest.mark.postgres
def test_concurrent_submitters_strand_no_command(pg_url) -> None:
    """Eight submitters against a reader that polls as an engine does: every committed command is
    read exactly once, in number order."""
    queue = CommandQueue.open(pg_url)
    per_thread, threads = 40, 8
    stop = threading.Event()
    read: list[int] = []

    def engine() -> None:
        last = 0
        while True:
            finished = stop.is_set()
            for command in queue.pending_after(last):
                read.append(command.id)
                last = command.seq
            if finished:
                return
            time.sleep(0.002)

    def submitter(n: int) -> None:
        for i in range(per_thread):
            queue.submit_purge(PurgeSelector(PurgeKind.TENANT, f"t{n}-{i}"), requested_by="t")

    reader = threading.Thread(target=engine)
    reader.start()
    workers = [threading.Thread(target=submitter, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    stop.set()
    reader.join(30)
    all_ids = [c.id for c in queue.pending_after(0, limit=10_000)]
    assert len(all_ids) == per_thread * threads
    assert sorted(read) == sorted(all_ids) and len(set(read)) == len(read)
    queue.engine.dispose()
