"""The connector's phase timers: wall time always, the thread's CPU time when a benchmark asks."""

from __future__ import annotations

import time

import pytest

from kvguard.engine_adapter.vllm.timing import PhaseTimer


def test_phases_accumulate_wall_time_and_calls_and_nest() -> None:
    timer = PhaseTimer()
    for _ in range(3):
        with timer.phase("outer"), timer.phase("inner"):
            time.sleep(0.01)
    snap = timer.snapshot()
    assert snap["outer"]["calls"] == snap["inner"]["calls"] == 3
    assert snap["outer"]["seconds"] >= snap["inner"]["seconds"] >= 0.03
    assert snap["outer"]["cpu_seconds"] == 0.0  # not asked for


def test_cpu_time_leaves_out_sleeping_and_an_exception_still_counts() -> None:
    timer = PhaseTimer(cpu=True)
    with timer.phase("sleep"):
        time.sleep(0.05)
    with pytest.raises(ValueError), timer.phase("fails"):
        raise ValueError("x")
    snap = timer.snapshot()
    assert snap["sleep"]["seconds"] >= 0.05 > snap["sleep"]["cpu_seconds"] * 5
    assert snap["fails"]["calls"] == 1
