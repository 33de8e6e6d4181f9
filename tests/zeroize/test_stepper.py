"""zeroize_async, PendingZeroize and StepZeroizer on CPU: results are applied only once complete.

On CPU the work is synchronous, so a handle is complete when returned; a `Gate` (a fake CUDA event)
delays completion to prove that nothing reads a verdict early, that the step path never waits unless
a block comes back while its clear is in flight, and that a failed handover stops the engine before
the block can be handed on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvguard.errors import ZeroizeError, ZeroizeVerificationError
from kvguard.zeroize import KVLayout, PendingZeroize, plan_zeroize, torch_exec, zeroize_async
from kvguard.zeroize.stepper import StepZeroizer
from tests.zeroize.factories import check_cleared, make_cache, snapshot


class Gate:
    """A fake event: complete once opened; `synchronize` opens it and counts the waits."""

    def __init__(self) -> None:
        self.open = False
        self.waits = 0

    def query(self) -> bool:
        return self.open

    def synchronize(self) -> None:
        self.waits += 1
        self.open = True


class Delayed:
    """A zeroizer whose calls complete only when their gate opens (one gate per call)."""

    def __init__(self) -> None:
        self.gates: list[Gate] = []
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, spec: Any, plan: Any, **kwargs: Any) -> PendingZeroize:
        pending = zeroize_async(spec, plan, **kwargs)
        gate = Gate()
        pending.delay_until(gate)
        self.gates.append(gate)
        self.calls.append(plan.block_ids)
        return pending


def _skip_clears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_exec, "zero_blocks", lambda *_args: None)


def test_a_cpu_handle_is_complete_when_returned() -> None:
    spec = make_cache(KVLayout.VLLM_CPU, torch.bfloat16, num_blocks=12)
    before = snapshot(spec)
    plan = plan_zeroize([1, 5, 6], spec.num_blocks)
    pending = zeroize_async(spec, plan, verify="full")
    assert pending.poll() and pending.done and pending.ok and pending.dirty_ids == ()
    evidence = pending.evidence()
    assert evidence.verified and evidence.blocks_verified == 3
    assert evidence.wall_time_us >= 0  # the enqueue's host time
    check_cleared(spec, before, plan)


def test_a_verdict_is_read_only_once_its_event_has_completed() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.float16, num_blocks=8)
    pending = zeroize_async(spec, plan_zeroize([2, 3], spec.num_blocks), verify="full")
    gate = Gate()
    pending.delay_until(gate)
    assert not pending.poll() and not pending.done
    with pytest.raises(ZeroizeError, match="not completed yet"):
        _ = pending.ok
    with pytest.raises(ZeroizeError, match="not completed yet"):
        pending.evidence()
    gate.open = True
    assert pending.poll() and pending.ok
    with pytest.raises(ZeroizeError, match="already completed"):
        pending.delay_until(Gate())


def test_a_failed_verdict_raises_from_evidence_and_names_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_cache(KVLayout.MLA, torch.int8, num_blocks=6)
    _skip_clears(monkeypatch)
    pending = zeroize_async(spec, plan_zeroize([4, 1], spec.num_blocks), verify="full")
    assert pending.poll() and not pending.ok and pending.dirty_ids == (1, 4)
    with pytest.raises(ZeroizeVerificationError, match="2 of 2 checked blocks"):
        pending.evidence()


def test_G2_release_verdicts_arrive_later_and_only_when_complete() -> None:
    spec = make_cache(KVLayout.VLLM_CPU, torch.bfloat16, num_blocks=16)
    delayed = Delayed()
    clears = StepZeroizer(spec, zeroizer=delayed)
    clears.submit(release=[3, 4], verify="sample")
    assert clears.collect() == [] and clears.pending == 1
    clears.submit(release=[9])  # an unrelated step: nothing waits
    assert [g.waits for g in delayed.gates] == [0, 0] and clears.pending == 2
    delayed.gates[1].open = True  # completion order need not follow submission order
    (second,) = clears.collect()
    assert second.blocks == (9,) and second.ok and not second.handover
    delayed.gates[0].open = True
    (first,) = clears.collect()
    assert first.blocks == (3, 4) and first.evidence is not None
    assert first.evidence.block_count == 2 and clears.pending == 0


def test_a_failed_release_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_cache(KVLayout.VLLM_CPU, torch.bfloat16, num_blocks=16)
    _skip_clears(monkeypatch)
    clears = StepZeroizer(spec)
    clears.submit(release=[7], verify="full")
    (result,) = clears.collect()
    assert (result.blocks, result.ok, result.evidence) == ((7,), False, None)


def test_G3_a_failed_handover_raises_once_its_verdict_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_blocks=16)
    _skip_clears(monkeypatch)
    delayed = Delayed()
    clears = StepZeroizer(spec, zeroizer=delayed)
    clears.submit(handover=[5], release=[6], verify="none")
    assert clears.collect() == []  # not complete: nothing known, nothing raised yet
    delayed.gates[0].open = True
    with pytest.raises(ZeroizeVerificationError, match="1 of 1 checked blocks"):
        clears.collect()


def test_G3_a_failed_handover_stops_the_step_that_would_hand_the_block_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_blocks=16)
    _skip_clears(monkeypatch)
    delayed = Delayed()
    clears = StepZeroizer(spec, zeroizer=delayed)
    clears.submit(handover=[5, 8])
    clears.submit(release=[2])  # does not touch 5 or 8: no wait
    assert [g.waits for g in delayed.gates] == [0, 0]
    # Block 8 leaves its new owner's scope while the handover verdict is still in flight: the step
    # waits for that one clear, sees it failed and raises before enqueuing anything of this step.
    with pytest.raises(ZeroizeVerificationError):
        clears.submit(release=[8])
    assert delayed.gates[0].waits == 1 and delayed.gates[1].waits == 0
    assert delayed.calls == [(5, 8), (2,)]


def test_handover_is_verified_in_full_and_drain_waits_for_everything() -> None:
    spec = make_cache(KVLayout.BLOCK_MAJOR, torch.float16, num_blocks=32)
    delayed = Delayed()
    clears = StepZeroizer(spec, zeroizer=delayed)
    clears.submit(handover=list(range(20)), release=[30, 31], verify="none")
    results = clears.drain()
    assert [r.handover for r in results] == [True, False]
    assert results[0].evidence is not None and results[0].evidence.blocks_verified == 20
    assert results[1].evidence is not None and results[1].evidence.verified is None
    assert clears.pending == 0 and all(g.waits == 1 for g in delayed.gates)
