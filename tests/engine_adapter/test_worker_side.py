"""The vLLM worker half with verdicts that arrive later (issue 14): CPU caches, no engine.

On CPU a clear completes at once and its result goes out with the same step; a delayed zeroizer
(tests/zeroize/test_stepper.py's `Delayed`, a fake CUDA event per call) shows what a GPU worker does:
results go out at a later step, `pending` says how many are on their way, a scheduler keeps release
blocks held until their verdict arrives, and a failed handover stops the worker.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")

from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, GuardWorkerMeta
from kvguard.engine_adapter.vllm.worker_side import WorkerGuard
from kvguard.errors import ZeroizeVerificationError
from kvguard.policy import PolicySet, TenantPolicy
from kvguard.zeroize import torch_exec
from tests.engine_adapter.test_scheduler_guard import (
    BLOCK,
    make_guard,  # noqa: F401  (fixture)
    request,
    schedule,
)
from tests.zeroize.test_stepper import Delayed

NUM_BLOCKS = 32


def _worker(zeroizer: Any = None) -> WorkerGuard:
    worker = WorkerGuard() if zeroizer is None else WorkerGuard(zeroizer=zeroizer)
    layer = torch.randint(1, 100, (NUM_BLOCKS, 2, 4, 16), dtype=torch.int16).to(torch.bfloat16)
    worker.register({"layer.0": layer, "layer.1": layer.clone()})
    return worker


def test_on_cpu_results_go_out_with_the_same_step() -> None:
    worker = _worker()
    worker.on_step(GuardStepMeta(step=1, release=(3, 4), handover=(7,), verify="full"))
    out = worker.take_results()
    assert isinstance(out, GuardWorkerMeta) and out.pending == 0
    assert [(r.blocks, r.ok, r.handover) for r in out.results] == [
        ((7,), True, True),
        ((3, 4), True, False),
    ]
    assert out.results[1].details["blocks_verified"] == 2
    assert worker.take_results() is None  # nothing new, nothing pending


def test_later_results_and_the_pending_count() -> None:
    delayed = Delayed()
    worker = _worker(delayed)
    worker.on_step(GuardStepMeta(step=1, release=(3,)))
    first = worker.take_results()
    assert first is not None and (first.results, first.pending) == ([], 1)
    worker.on_step(GuardStepMeta(step=2))
    second = worker.take_results()
    assert second is not None and (second.results, second.pending) == ([], 1)
    delayed.gates[0].open = True
    worker.on_step(GuardStepMeta(step=3))
    third = worker.take_results()
    assert third is not None and third.pending == 0 and [r.blocks for r in third.results] == [(3,)]
    assert worker.take_results() is None
    assert delayed.gates[0].waits == 0  # nothing on the step path waited


def test_aggregate_adds_pending_counts() -> None:
    one = GuardWorkerMeta(results=[], pending=2)
    both = one.aggregate(GuardWorkerMeta(results=[], pending=1))
    assert isinstance(both, GuardWorkerMeta) and both.pending == 3


def test_G3_a_late_failed_handover_stops_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_exec, "zero_blocks", lambda *_args: None)
    delayed = Delayed()
    worker = _worker(delayed)
    worker.on_step(GuardStepMeta(step=1, handover=(5,)))
    assert worker.take_results() is not None  # pending, no verdict yet
    # The block is planned for release before its handover verdict was read: the step waits for
    # that clear, finds it failed, and raises before enqueuing anything.
    with pytest.raises(ZeroizeVerificationError):
        worker.on_step(GuardStepMeta(step=2, release=(5,)))
    assert delayed.calls == [(5,)]


def test_G2_release_blocks_stay_held_until_a_late_verdict_arrives(make_guard: Any) -> None:  # noqa: F811
    guard, f = make_guard(PolicySet(default=TenantPolicy(retention={"ttl_s": 0, "idle_s": 0})))
    delayed = Delayed()
    worker = _worker(delayed)
    a = request("a", 2 * BLOCK)
    guard.on_new_request(a)
    worker.on_step(guard.build_step(schedule(new=[(a, [3, 4], 0)])))
    guard.on_worker_output(worker.take_results())
    guard.request_finished(a)
    step = guard.build_step(schedule())
    assert sorted(step.release) == [3, 4]
    worker.on_step(step)
    for _ in range(2):  # two steps without a verdict: the blocks stay held, nothing is freed
        guard.on_worker_output(worker.take_results())
        assert f.pool.blocks[3].ref_cnt == 1 and 3 not in f.pool.freed and guard.has_pending()
        worker.on_step(guard.build_step(schedule()))
    delayed.gates[0].open = True
    guard.on_worker_output(worker.take_results())
    assert sorted(f.pool.freed) == [3, 4] and f.pool.blocks[3].ref_cnt == 0
    assert guard.stats["blocks_zeroized"] == 2
    assert "block.zeroize" in f.ledger.kinds()


def test_G2_a_late_failed_release_is_planned_again(
    make_guard: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    guard, f = make_guard(PolicySet(default=TenantPolicy(retention={"ttl_s": 0, "idle_s": 0})))
    delayed = Delayed()
    worker = _worker(delayed)
    a = request("a", BLOCK)
    guard.on_new_request(a)
    worker.on_step(guard.build_step(schedule(new=[(a, [6], 0)])))
    guard.on_worker_output(worker.take_results())
    guard.request_finished(a)
    with monkeypatch.context() as patch:
        patch.setattr(torch_exec, "zero_blocks", lambda *_args: None)
        worker.on_step(guard.build_step(schedule()))  # release (6,), the clear is skipped
    guard.on_worker_output(worker.take_results())
    assert guard.build_step(schedule()).release == ()  # still in flight: not planned twice
    delayed.gates[-1].open = True
    worker.on_step(GuardStepMeta(step=99))
    guard.on_worker_output(worker.take_results())
    assert guard.stats["zeroize_failures"] == 1 and f.pool.blocks[6].ref_cnt == 1
    retry = guard.build_step(schedule())
    assert retry.release == (6,)  # quarantined, planned again
    worker.on_step(retry)
    delayed.gates[-1].open = True
    guard.on_worker_output(worker.take_results())
    assert f.pool.freed == [6]


def test_caches_of_another_block_count_than_the_scheduler_are_refused() -> None:
    """A backend that splits each scheduler block into several kernel rows registers more rows
    than the scheduler has blocks: kvguard would clear row b for block b, the wrong bytes (found by
    a review). Refused at registration; the same count (or none known) registers."""
    from kvguard.errors import ZeroizeError  # noqa: PLC0415

    layer = torch.zeros((NUM_BLOCKS, 2, 4, 16), dtype=torch.bfloat16)
    split = WorkerGuard(scheduler_blocks=lambda: NUM_BLOCKS // 2)
    with pytest.raises(ZeroizeError, match="cannot map the scheduler's block ids"):
        split.register({"layer.0": layer})
    for known in (NUM_BLOCKS, None):
        WorkerGuard(scheduler_blocks=lambda known=known: known).register({"layer.0": layer})


def test_the_cache_layout_is_read_from_the_tensors_not_the_device() -> None:
    """vLLM 0.32 views every device's cache per layer as `[B, H, N, C]` (the CPU backend's shape);
    chosen by device, a GPU engine's caches were taken for `[2, B, N, H, C]` and refused (found by
    a review). Both shapes register, on any device; anything else is refused."""
    from kvguard.errors import CacheLayoutError  # noqa: PLC0415
    from kvguard.zeroize import KVLayout  # noqa: PLC0415

    cases = [
        ((NUM_BLOCKS, 2, 32, 16), KVLayout.VLLM_CPU),  # [B, H, N, C]
        ((2, NUM_BLOCKS, 32, 2, 8), KVLayout.VLLM_FLASH),  # [2, B, N, H, C]
    ]
    for shape, layout in cases:
        worker = WorkerGuard()
        worker.register({"layer.0": torch.zeros(shape, dtype=torch.bfloat16)})
        assert worker._spec is not None and worker._spec.layout is layout
        assert worker._spec.num_blocks == NUM_BLOCKS
    with pytest.raises(CacheLayoutError):
        WorkerGuard().register({"layer.0": torch.zeros((NUM_BLOCKS, 64), dtype=torch.bfloat16)})


@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC", "BLHNC"])
def test_vllms_own_cache_views_are_cleared_exactly_or_refused(layout_name: str) -> None:
    """vLLM 0.32 views one backing buffer per layer with strides permuted by the backend's cache
    layout (`create_kv_cache_views`): LBNHC, the CUDA default, is not contiguous, and kvguard
    refused it. Built here by vLLM's own function: the planned blocks of every layer are cleared,
    and not one other byte; a layout with other layers' pages between a layer's blocks is refused."""
    from vllm.v1 import kv_cache_interface as vkv  # noqa: PLC0415
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415

    from kvguard.errors import CacheLayoutError  # noqa: PLC0415

    layout = KVCacheLayout[layout_name]
    spec = vkv.FullAttentionSpec(32, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    page, layers, blocks = spec.page_size_bytes, 3, 8
    strides = (page * blocks, page) if layout.is_layer_compact else (page, page * layers)
    placement = vkv.KVCacheTensor(
        size=page * layers * blocks,
        layers=[f"layer.{i}" for i in range(layers)],
        layer_stride=strides[0],
        block_stride=strides[1],
    )

    def views(raw: torch.Tensor) -> dict[str, torch.Tensor]:
        made = vkv.create_kv_cache_views(raw, spec, blocks, layout, placement)
        return dict(zip(placement.layers, made, strict=True))

    raw = torch.randint(1, 127, (placement.size,), dtype=torch.int8)
    worker = WorkerGuard()
    if not layout.is_layer_compact:
        with pytest.raises(CacheLayoutError, match="other layers' bytes"):
            worker.register(views(raw))
        return
    worker.register(views(raw))
    expected = raw.clone()
    for view in views(expected).values():
        view[[2, 5]] = 0
    worker.on_step(GuardStepMeta(step=1, handover=(2, 5), verify="full"))
    out = worker.take_results()
    assert isinstance(out, GuardWorkerMeta) and [r.ok for r in out.results] == [True]
    assert torch.equal(raw, expected)


def test_two_views_from_one_address_with_other_strides_are_both_checked() -> None:
    """Layers were told apart by start address and shape only: a second view of the same start
    with other strides was dropped as a repeat, never checked nor cleared (found by a re-test)."""
    from kvguard.errors import CacheLayoutError  # noqa: PLC0415
    from kvguard.zeroize import KVCacheSpec  # noqa: PLC0415

    base = torch.zeros(64, dtype=torch.uint8)
    dense = base[:32].view(4, 2, 4).transpose(1, 2).unsqueeze(1)  # [4, 1, 4, 2], 8-byte pages
    spread = base.as_strided((4, 1, 4, 2), (16, 1, 1, 4), 0)  # same start and shape, 16 apart
    with pytest.raises(CacheLayoutError):
        KVCacheSpec.vllm_views([dense, spread])
    assert KVCacheSpec.vllm_views([dense, dense]).num_layers == 1  # a true repeat: once
