"""`PendingZeroize`: a zeroization enqueued on a stream, whose verdict is read once it has completed.

`zeroize_async` returns one. Nothing about it blocks unless asked to: `poll()` asks the call's last
event whether the device has finished (no wait) and, the first time it has, reads the verdict (the
read-back flags, the device timings) and gives the call's buffers back; `wait()` blocks on that one
event only (never on the device or the rest of the stream's future work). Until then `ok`, `dirty_ids`
and `evidence()` refuse, so no caller can act on a result that does not exist yet.

Off the GPU the work runs synchronously and the handle is complete when returned: the API is the same
on every device, so callers (the vLLM worker) have one code path.

A failed verification is not returned as evidence: `evidence()` raises `ZeroizeVerificationError`
(STYLE.md, habit 4); `ok` and `dirty_ids` let a caller that must keep going (a release, whose blocks
stay quarantined) decide without catching.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Protocol

from kvguard.errors import ZeroizeError
from kvguard.zeroize import _log
from kvguard.zeroize.evidence import Method, VerifyMode, ZeroizeEvidence
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.plan import ZeroizePlan
from kvguard.zeroize.verify import dirty_blocks_error


class Completion(Protocol):
    """What a handle waits on: a CUDA event has both methods."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Complete:
    """Work that finished before the handle was made (the synchronous CPU path)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


COMPLETE: Completion = _Complete()


@dataclass(frozen=True)
class _Both:
    first: Completion
    second: Completion

    def query(self) -> bool:
        return self.first.query() and self.second.query()

    def synchronize(self) -> None:
        self.first.synchronize()
        self.second.synchronize()


# Plain slotted classes, not frozen dataclasses: one of each per zeroization, and a frozen dataclass's
# `__init__` (one `object.__setattr__` per field) alone cost several microseconds on the GPU host.


class Readout:
    """What the device reported: dirty ids among those checked, and CUDA-event times."""

    __slots__ = ("check_us", "clear_us", "dirty")

    def __init__(
        self, dirty: tuple[int, ...], clear_us: float | None, check_us: float | None
    ) -> None:
        self.dirty = dirty
        self.clear_us = clear_us
        self.check_us = check_us


class CallFacts:
    """What the host knew when it enqueued the call (becomes the evidence with the readout)."""

    __slots__ = ("checked", "device", "enqueue_us", "method", "mode", "plan", "spec", "started_at")

    def __init__(  # noqa: PLR0917 (one field each, in the evidence's order)
        self,
        spec: KVCacheSpec,
        plan: ZeroizePlan,
        mode: VerifyMode,
        method: Method,
        device: str,
        checked: int,  # blocks read back
        started_at: datetime | float,  # a float: POSIX time of the default clock (executor.utc_now)
        enqueue_us: float,  # host time of the enqueue
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.mode = mode
        self.method = method
        self.device = device
        self.checked = checked
        self.started_at = started_at
        self.enqueue_us = enqueue_us


class PendingZeroize:
    """A zeroization in flight (module docstring)."""

    __slots__ = ("_completion", "_evidence", "_facts", "_read", "_readout")

    def __init__(
        self, facts: CallFacts, completion: Completion, read: Callable[[], Readout]
    ) -> None:
        self._facts = facts
        self._completion = completion
        self._read: Callable[[], Readout] | None = read
        self._readout: Readout | None = None
        self._evidence: ZeroizeEvidence | None = None

    @property
    def plan(self) -> ZeroizePlan:
        return self._facts.plan

    @property
    def done(self) -> bool:
        """True once the verdict has been read (by `poll()` or `wait()`)."""
        return self._readout is not None

    def poll(self) -> bool:
        """True when the call has completed on the device; never blocks."""
        if self._readout is None:
            if not self._completion.query():
                return False
            self._finish()
        return True

    def wait(self) -> None:
        """Block until this call (only) has completed on the device."""
        if self._readout is None:
            self._completion.synchronize()
            self._finish()

    def delay_until(self, completion: Completion) -> None:
        """Report completion only once `completion` has completed too (tests: a delayed event)."""
        if self._readout is not None:
            raise ZeroizeError("the zeroization has already completed")
        self._completion = _Both(self._completion, completion)

    @property
    def ok(self) -> bool:
        """Every block read back was all-zero (True when nothing was read back)."""
        return not self._done_readout().dirty

    @property
    def dirty_ids(self) -> tuple[int, ...]:
        return self._done_readout().dirty

    def evidence(self, *, wall_time_us: float | None = None) -> ZeroizeEvidence:
        """The evidence of a passed call; raises ZeroizeVerificationError if a block was dirty.

        `wall_time_us` defaults to the host time of the enqueue (a synchronous caller passes its
        whole call's time).
        """
        readout = self._done_readout()
        facts = self._facts
        if readout.dirty:
            raise dirty_blocks_error(list(readout.dirty), facts.checked, facts.mode)
        if self._evidence is None:
            self._evidence = _build_evidence(facts, readout)
            # Debug: an engine releases blocks every step; the ledger, not the log, is the record.
            if _log.enabled(logging.DEBUG):
                _log.event(logging.DEBUG, "zeroize.done", **self._evidence.as_audit_details())
        if wall_time_us is None:
            return self._evidence
        return replace(self._evidence, wall_time_us=wall_time_us)

    def _done_readout(self) -> Readout:
        if self._readout is None:
            raise ZeroizeError("the zeroization has not completed yet: poll() or wait() first")
        return self._readout

    def _finish(self) -> None:
        read, self._read = self._read, None
        assert read is not None, "a handle's verdict is read once"
        self._readout = read()
        if self._readout.dirty:
            _log.event(logging.ERROR, "zeroize.verify_failed",
                       dirty_count=len(self._readout.dirty), checked_count=self._facts.checked)  # fmt: skip


def _build_evidence(facts: CallFacts, readout: Readout) -> ZeroizeEvidence:
    spec, plan = facts.spec, facts.plan
    started_at = facts.started_at
    if not isinstance(started_at, datetime):
        started_at = datetime.fromtimestamp(started_at, UTC)
    return ZeroizeEvidence(
        block_count=len(plan.block_ids),
        block_ids_sha256=plan.block_ids_digest(),
        cache_blocks=spec.num_blocks,
        layers=spec.num_layers,
        layout=str(spec.layout),
        dtype=str(spec.dtype).removeprefix("torch."),
        bytes_cleared=len(plan.block_ids) * spec.bytes_per_block,
        method=facts.method,
        device=facts.device,
        verify_mode=facts.mode,
        blocks_verified=facts.checked,
        verified=True if facts.checked else None,
        device_time_us=readout.clear_us,
        verify_time_us=readout.check_us,
        wall_time_us=facts.enqueue_us,
        timestamp=started_at,
    )
