"""Cheap per-phase timers for the connector's own cost (reported by benchmarks/engine_overhead.py and
benchmarks/scheduler_share.py).

Wall time by default. A benchmark can ask for the calling thread's CPU time as well (`cpu=True`):
on a shared machine, or beside kvguard's own background threads (the ledger writer holds the GIL
while it builds entries), wall time includes waiting for a core or the GIL; CPU time does not.
"""

from __future__ import annotations

import time


class PhaseTimer:
    """Accumulates wall time (and, with `cpu=True`, thread CPU time) and call counts per phase."""

    def __init__(self, *, cpu: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.cpu = cpu

    def phase(self, name: str) -> _Phase:
        """A context manager timing one run of `name` (a plain class: a generator-based context
        manager cost about 2 us per use, several times a step)."""
        return _Phase(self, name)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "seconds": self.seconds[name],
                "cpu_seconds": self.cpu_seconds.get(name, 0.0),
                "calls": self.calls[name],
            }
            for name in sorted(self.seconds)
        }


class _Phase:
    __slots__ = ("cpu_start", "name", "start", "timer")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer = timer
        self.name = name

    def __enter__(self) -> None:
        self.cpu_start = time.thread_time() if self.timer.cpu else 0.0
        self.start = time.perf_counter()

    def __exit__(self, *_exc: object) -> None:
        spent = time.perf_counter() - self.start
        timer, name = self.timer, self.name
        timer.seconds[name] = timer.seconds.get(name, 0.0) + spent
        if timer.cpu:
            timer.cpu_seconds[name] = (
                timer.cpu_seconds.get(name, 0.0) + time.thread_time() - self.cpu_start
            )
        timer.calls[name] = timer.calls.get(name, 0) + 1
