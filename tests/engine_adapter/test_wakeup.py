"""The idle waker: finds the engine-core input queue, and wakes it for new commands and for expiry."""

from __future__ import annotations

import queue
import time
from pathlib import Path

from kvguard.engine_adapter.commands import CommandQueue
from kvguard.engine_adapter.records import PurgeKind, PurgeSelector
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


def _waker(tmp_path: Path, *, last: list[int], cached: list[int], expiry_s: float = 60.0):
    commands = CommandQueue.open(f"sqlite:///{tmp_path / 'c.db'}")
    woken: list[float] = []
    inbox: queue.Queue[object] = queue.Queue()
    waker = IdleWaker(
        inbox,
        commands=CommandQueue.open(f"sqlite:///{tmp_path / 'c.db'}"),
        last_command=lambda: last[0],
        cached_blocks=lambda: cached[0],
        request_wake=lambda: woken.append(time.monotonic()),
        item=WAKE,
        check_s=0.05,
        expiry_s=expiry_s,
    )
    return waker, commands, inbox, woken


def test_a_new_command_wakes_the_engine_once_it_has_run_it_no_more(tmp_path: Path) -> None:
    last = [0]
    waker, commands, inbox, woken = _waker(tmp_path, last=last, cached=[0])
    try:
        time.sleep(0.3)
        assert inbox.empty() and not woken  # nothing new: an idle engine stays asleep
        command_id = commands.submit_purge(PurgeSelector(PurgeKind.TENANT, "t"), requested_by="x")
        assert inbox.get(timeout=2.0) == WAKE and woken
        last[0] = command_id  # the engine ran it
        time.sleep(0.2)
        while not inbox.empty():
            inbox.get_nowait()
        time.sleep(0.3)
        assert inbox.empty()
    finally:
        waker.close()
        commands.engine.dispose()


def test_cached_blocks_wake_the_engine_for_expiry_at_the_expiry_interval(tmp_path: Path) -> None:
    cached = [0]
    waker, commands, inbox, woken = _waker(tmp_path, last=[0], cached=cached, expiry_s=0.2)
    try:
        time.sleep(0.5)
        assert inbox.empty()  # nothing cached: nothing can expire
        cached[0] = 3
        time.sleep(1.0)
        assert 2 <= waker.wakes <= 6  # about every 0.2 s, not every check (0.05 s)
        assert len(woken) == waker.wakes
    finally:
        waker.close()
        commands.engine.dispose()
