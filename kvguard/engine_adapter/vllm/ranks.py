"""Tensor parallelism: every worker clears its own shard; custody hears of a clear once, when every
rank has reported it (issue 14 item 4).

Under tensor parallel N each worker process holds a shard of every block (its attention heads), and
each one clears its shard before its forward pass. vLLM hands the scheduler the workers' messages
concatenated (`GuardWorkerMeta.aggregate`), and on a GPU the ranks' verdicts may arrive at different
steps. `RankMerger` holds each clear's per-rank verdicts until all N are in, then yields one result:

- it passes only if every rank's shard passed; a release clear with a failed shard stays quarantined
  and is cleared again on every rank (clearing twice is harmless), so a block returns to the free pool
  only when every rank has reported it clean;
- its evidence is one entry that names the ranks (`tp_size`, `tp_ranks`) with the bytes cleared on all
  of them, the slowest rank's times and the fewest blocks any rank read back.

A clear is identified by the step whose plan ordered it, handover or release, and its block ids
(`ZeroizeResult.step`): every rank's verdict of one clear carries the same key, so verdicts of
different clears of the same blocks never pair up (before the step was part of the key, a rank's
verdict delivered twice was paired with another rank's verdict of the block's next clear, found by
a review), and a rank's second verdict of a clear still open is ignored. The merger also knows
which clears the scheduler ordered (`expect`, every step's plan) and drops any verdict that answers
none of them, at any number of ranks: one delivered twice, or naming a clear no step planned,
never frees a block another owner holds by now (`ignored` counts them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from kvguard.engine_adapter.vllm.metadata import ZeroizeResult
from kvguard.logging import get_logger

_log = get_logger("vllm.ranks")

_SUMMED: Final = ("bytes_cleared",)
_SLOWEST: Final = ("device_time_us", "verify_time_us", "wall_time_us")
_FEWEST: Final = ("blocks_verified",)
_Key = tuple[int, bool, tuple[int, ...]]


class RankMerger:
    """Per-rank verdicts in, one verdict per clear out (module docstring)."""

    def __init__(self, ranks: int) -> None:
        if ranks < 1:
            raise ValueError("a worker group has at least one rank")
        self.ranks = ranks
        self._open: dict[_Key, dict[int, ZeroizeResult]] = {}
        self._expected: set[_Key] = set()  # clears ordered and not yet answered by every rank
        self.ignored = 0  # verdicts that answered no expected clear

    def expect(self, step: int, *, handover: tuple[int, ...], release: tuple[int, ...]) -> None:
        """The clears a step's plan orders (verdicts of nothing else are ignored)."""
        if handover:
            self._expected.add((step, True, handover))
        if release:
            self._expected.add((step, False, release))

    @property
    def waiting(self) -> int:
        """Clears some but not all ranks have reported."""
        return len(self._open)

    def add(self, results: Iterable[ZeroizeResult]) -> list[ZeroizeResult]:
        done: list[ZeroizeResult] = []
        expected = self._expected
        for result in results:
            if not 0 <= result.rank < self.ranks:
                raise ValueError(f"a verdict from rank {result.rank} of {self.ranks}")
            key = (result.step, result.handover, tuple(result.blocks))
            if key not in expected:
                self.ignored += 1
                _log.error("a clear verdict that answers no planned clear ignored")
                continue
            if self.ranks == 1:
                expected.discard(key)
                done.append(result)
                continue
            entry = self._open.setdefault(key, {})
            if result.rank in entry:
                _log.error("a rank's second verdict of one clear ignored", rank=result.rank)
                continue
            entry[result.rank] = result
            if len(entry) == self.ranks:
                del self._open[key]
                expected.discard(key)
                done.append(self._merge(key, entry))
        return done

    def _merge(self, key: _Key, by_rank: dict[int, ZeroizeResult]) -> ZeroizeResult:
        step, handover, blocks = key
        if not all(r.ok for r in by_rank.values()):
            return ZeroizeResult(blocks, False, handover, rank=0, step=step)
        shards = [by_rank[rank].details for rank in sorted(by_rank)]
        details: dict[str, Any] = dict(shards[0])
        for name in _SUMMED:
            values = [d.get(name) for d in shards]
            if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                details[name] = sum(values)
        for name, pick in [(n, max) for n in _SLOWEST] + [(n, min) for n in _FEWEST]:
            numbers = [d[name] for d in shards if isinstance(d.get(name), int | float)]
            if numbers:
                details[name] = pick(numbers)
        verdicts = [d.get("verified") for d in shards]
        details["verified"] = None if None in verdicts else all(verdicts)
        details["tp_size"] = self.ranks
        details["tp_ranks"] = f"0-{self.ranks - 1}"
        return ZeroizeResult(blocks, True, handover, details, rank=0, step=step)
