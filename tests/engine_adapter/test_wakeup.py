"""The idle waker: finds the engine-core input queue, and wakes it for new commands and for expiry."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from kvguard.control.commands import CommandQueue
from kvguard.engine_adapter.records import PurgeKind, PurgeSelector
from kvguard.engine_adapter.vllm.engine_link import EngineLink
from kvguard.engine_adapter.vllm.wakeup import IdleWaker, find_engine_input_queue

WAKE = ("wake", None)


class FakeEngineCore:
    """Like vLLM's EngineCoreProc: the input queue exists before the connector is constructed."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[object] = queue.Queue()
        self.found = find_engine_input_queue()


def test_the_input_queue_is_found_from_inside_the_engine_core_constructor() -> None:
    core = FakeEngineCore()
    assert core.found is core.input_queue
    assert find_engine_input_queue() is None  # not inside an engine core: in-process engines


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _waker(tmp_path: Path, *, last: list[int], cached: list[int], expiry_s: float = 60.0):
    commands = CommandQueue.open(f"sqlite:///{tmp_path / 'c.db'}")
    woken: list[float] = []
    inbox: queue.Queue[object] = queue.Queue()
    clock = Clock()
    waker = IdleWaker(
        inbox,
        commands=commands,
        last_command=lambda: last[0],
        cached_blocks=lambda: cached[0],
        request_wake=lambda: woken.append(clock()),
        item=WAKE,
        expiry_s=expiry_s,
        clock=clock,
    )
    return waker, commands, inbox, woken, clock


def test_a_new_command_wakes_the_engine_once_it_has_run_it_no_more(tmp_path: Path) -> None:
    last = [0]
    waker, commands, inbox, woken, _clock = _waker(tmp_path, last=last, cached=[0])
    assert not waker.check() and inbox.empty() and not woken  # an idle engine stays asleep
    commands.submit_purge(PurgeSelector(PurgeKind.TENANT, "t"), requested_by="x")
    assert waker.check() and inbox.get_nowait() == WAKE and woken
    last[0] = commands.latest_seq()  # the engine ran it
    assert not waker.check() and inbox.empty()
    commands.engine.dispose()


def test_cached_blocks_wake_the_engine_for_expiry_at_the_expiry_interval(tmp_path: Path) -> None:
    cached = [0]
    waker, commands, inbox, woken, clock = _waker(tmp_path, last=[0], cached=cached, expiry_s=5)
    clock.now += 10
    assert not waker.check()  # nothing cached: nothing can expire
    cached[0] = 3
    assert waker.check()
    clock.now += 2
    assert not waker.check()  # not every check: every expiry interval
    clock.now += 3
    assert waker.check() and waker.wakes == 2 == len(woken) == inbox.qsize()
    commands.engine.dispose()


def test_the_engine_link_runs_its_chores_on_one_thread(tmp_path: Path) -> None:
    """The waker's check and the keep-alive run on the link's one thread, which keeps running when a
    chore fails."""
    link = EngineLink.open(f"sqlite:///{tmp_path / 'c.db'}", None)
    seen: list[str] = []
    failures = [0]

    def flaky() -> None:
        failures[0] += 1
        raise sa.exc.OperationalError("SELECT", {}, Exception("down"))

    link.every(0.05, lambda: seen.append(threading.current_thread().name))
    link.every(0.05, flaky)
    link.start()
    try:
        deadline = time.monotonic() + 5
        while (len(seen) < 3 or failures[0] < 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(seen) >= 3 and failures[0] >= 3
        assert set(seen) == {"kvguard-command-listener"}
        assert not link.take_notified()  # SQLite: no notifications, the engine polls
    finally:
        link.close()


def test_tasks_handed_to_the_link_run_once_in_order_on_its_thread(tmp_path: Path) -> None:
    """`call_soon` (the scheduler's heartbeat writes): once each, in order, on the link's thread, a
    failing one logged and the next still run; what is still queued at close is dropped."""
    link = EngineLink.open(f"sqlite:///{tmp_path / 'c.db'}", None)
    ran: list[tuple[int, str]] = []

    def task(n: int) -> None:
        ran.append((n, threading.current_thread().name))
        if n == 1:
            raise sa.exc.OperationalError("UPDATE", {}, Exception("down"))

    for n in range(3):
        link.call_soon(lambda n=n: task(n))
    link.start()
    try:
        deadline = time.monotonic() + 5
        while len(ran) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)  # another tick or more: nothing runs twice
        assert [n for n, _ in ran] == [0, 1, 2]
        assert {name for _, name in ran} == {"kvguard-command-listener"}
    finally:
        link.close()
    link.call_soon(lambda: task(9))  # after close: never run
    time.sleep(0.6)
    assert len(ran) == 3


def test_figures_changed_since_the_last_heartbeat_wake_an_idle_engine(tmp_path: Path) -> None:
    """An engine that went idle right after a burst ran no step, so its figures never reached the
    registry (found by a review: /metrics said requests_total 1 after five requests). The waker
    makes it step once when a heartbeat is due and figures changed since the last one."""
    commands = CommandQueue.open(f"sqlite:///{tmp_path / 'c.db'}")
    stale = [False]
    inbox: queue.Queue[object] = queue.Queue()
    waker = IdleWaker(
        inbox,
        commands=commands,
        last_command=lambda: 0,
        cached_blocks=lambda: 0,
        request_wake=lambda: None,
        figures_stale=lambda: stale[0],
        item=WAKE,
        clock=Clock(),
    )
    assert not waker.check() and inbox.empty()
    stale[0] = True
    assert waker.check() and inbox.get_nowait() == WAKE
    stale[0] = False  # the step took the figures
    assert not waker.check()
    commands.engine.dispose()
