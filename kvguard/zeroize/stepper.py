"""`StepZeroizer`: an engine worker's clears, enqueued before each forward pass and never waited for.

An engine worker calls `submit` before each step's forward pass with the step's handover blocks (given
to a new scope this step, G3) and release blocks (leaving their scope for good, G2), and `collect`
after it. `submit` enqueues the clears and read-backs on the engine's stream (`zeroize_async`); the
verdicts are picked up by `collect` (or the next `submit`) once their events have completed, usually
one step later, with no host synchronization on the step path. The engine-specific adapter (the vLLM
worker) turns the `ClearResult`s into its messages; this class needs only torch (and Triton on GPU),
so the engine-shaped benchmark drives exactly this code.

Why a late verdict is still safe:

- The clear and its read-back are enqueued before the step's forward pass on the same stream, so the
  read-back sees the bytes as the clear left them, before the new owner writes: the verdict is the
  same one a synchronous call would give, only read later.
- Release blocks stay quarantined (out of the free pool) until a passing verdict reaches the
  scheduler; a failed one keeps them quarantined. A late verdict only keeps them out longer.
- A failed handover verdict raises `ZeroizeVerificationError` wherever it is read, which stops the
  engine. It is read before the block can be handed on: a block can only leave its new owner's scope
  through a later step's handover or release list, and `submit` first waits for (only) the in-flight
  calls that touch one of the blocks it is given, then raises on a failure before enqueuing anything
  of that step. The new owner's own forward passes in between never read the residue (attention
  reads only the positions the owner has written).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvguard.zeroize import _log
from kvguard.zeroize.evidence import VerifyMode, ZeroizeEvidence
from kvguard.zeroize.executor import zeroize_async
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.pending import PendingZeroize
from kvguard.zeroize.plan import plan_zeroize
from kvguard.zeroize.verify import dirty_blocks_error

# `zeroize_async`'s signature; tests pass a wrapper that delays completion.
Zeroizer = Callable[..., PendingZeroize]


@dataclass(frozen=True)
class ClearResult:
    """The verdict of one submitted clear. `evidence` is None when verification failed (releases
    only: a failed handover raises instead)."""

    blocks: tuple[int, ...]
    handover: bool
    evidence: ZeroizeEvidence | None
    tag: int = 0  # the caller's name for the submission (vLLM's worker: the scheduler's step)

    @property
    def ok(self) -> bool:
        return self.evidence is not None


@dataclass(frozen=True)
class _InFlight:
    blocks: tuple[int, ...]
    handover: bool
    pending: PendingZeroize
    tag: int


class StepZeroizer:
    """In-flight clears of one engine worker's cache (module docstring)."""

    def __init__(
        self, spec: KVCacheSpec, *, zeroizer: Zeroizer = zeroize_async, **options: Any
    ) -> None:
        self._spec = spec
        self._zeroizer = zeroizer
        self._options = options  # passed to every call, e.g. stream=..., method=...
        self._inflight: list[_InFlight] = []
        self._finished: list[ClearResult] = []

    @property
    def pending(self) -> int:
        """Clears submitted whose verdict has not been read yet."""
        return len(self._inflight)

    def submit(
        self,
        *,
        handover: Sequence[int] = (),
        release: Sequence[int] = (),
        verify: VerifyMode | str = VerifyMode.SAMPLE,
        tag: int = 0,
    ) -> None:
        """Enqueue this step's clears (handover blocks always verified in full) before its forward;
        their verdicts carry `tag`, so the caller can tell which submission each one answers.

        Raises ZeroizeVerificationError if an earlier handover clear failed: first for those that touch
        this step's blocks (waiting for them if needed), then for any other already complete.
        """
        if self._inflight:
            self._read(must_finish={*handover, *release})
        if handover:
            self._enqueue(tuple(handover), True, VerifyMode.FULL, tag)
        if release:
            self._enqueue(tuple(release), False, verify, tag)

    def collect(self) -> list[ClearResult]:
        """Verdicts that have arrived since the last call; never blocks. Raises on a failed handover."""
        if self._inflight:
            self._read(must_finish=None)
        out, self._finished = self._finished, []
        return out

    def drain(self) -> list[ClearResult]:
        """Wait for every in-flight clear and return all verdicts (shutdown, tests)."""
        for item in self._inflight:
            item.pending.wait()
        return self.collect()

    def _enqueue(
        self, blocks: tuple[int, ...], handover: bool, verify: VerifyMode | str, tag: int
    ) -> None:
        plan = plan_zeroize(blocks, self._spec.num_blocks)
        pending = self._zeroizer(self._spec, plan, verify=verify, **self._options)
        self._inflight.append(_InFlight(blocks, handover, pending, tag))

    def _read(self, must_finish: set[int] | None) -> None:
        still: list[_InFlight] = []
        for item in self._inflight:
            if must_finish and not must_finish.isdisjoint(item.blocks):
                item.pending.wait()  # rare: a block comes back before its last clear was read
            if item.pending.poll():
                self._finish(item)
            else:
                still.append(item)
        self._inflight = still

    def _finish(self, item: _InFlight) -> None:
        pending = item.pending
        if pending.ok:
            self._finished.append(
                ClearResult(item.blocks, item.handover, pending.evidence(), item.tag)
            )
            return
        if item.handover:
            # The new owner got a block holding another scope's bytes: stop the engine (G3, G7).
            self._inflight = []
            raise dirty_blocks_error(
                list(pending.dirty_ids), len(pending.plan.block_ids), VerifyMode.FULL
            )
        _log.event(logging.ERROR, "zeroize.release_failed", block_count=len(item.blocks))
        self._finished.append(ClearResult(item.blocks, False, None, item.tag))
