"""The Triton executor on a real GPU (skipped without CUDA; run on the device machine)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvguard.errors import ZeroizeVerificationError
from kvguard.zeroize import (
    KVCacheSpec,
    KVLayout,
    Method,
    _driver,
    plan_zeroize,
    triton_exec,
    verify_zeroized,
    zeroize,
    zeroize_async,
)
from kvguard.zeroize.executor import TIMING_EVERY
from kvguard.zeroize.staging import StagingPool
from kvguard.zeroize.stepper import StepZeroizer
from tests.zeroize.factories import check_cleared, layout_dtype_cases, make_cache, snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REALISTIC = {"block_size": 16, "heads": 8, "head_size": 128}  # Llama-3-8B blocks, 32 KiB in bf16
IRREGULAR = {"block_size": 5, "heads": 3, "head_size": 7}


@pytest.mark.parametrize("sizes", [REALISTIC, IRREGULAR], ids=["realistic", "irregular"])
@pytest.mark.parametrize(("layout", "dtype"), layout_dtype_cases())
def test_G2_triton_clears_planned_blocks_and_nothing_else(
    layout: KVLayout, dtype: torch.dtype, sizes: dict[str, int]
) -> None:
    spec = make_cache(layout, dtype, num_layers=3, num_blocks=37, device="cuda", **sizes)
    before = snapshot(spec)
    plan = plan_zeroize([0, 1, 2, 9, 20, 21, 36], spec.num_blocks)
    evidence = zeroize(spec, plan, verify="full")
    assert evidence.method is Method.TRITON
    assert evidence.device_time_us is not None and evidence.device_time_us > 0
    assert evidence.verify_time_us is not None
    check_cleared(spec, before, plan)


def test_large_scattered_plan_uses_the_persistent_grid() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=4, num_blocks=4096,
                      device="cuda", **REALISTIC)  # fmt: skip
    before = snapshot(spec)
    plan = plan_zeroize(random.Random(5).sample(range(4096), 2048), spec.num_blocks)
    zeroize(spec, plan, verify="full")
    check_cleared(spec, before, plan)


def test_multi_tile_masked_chunks() -> None:
    spec = make_cache(KVLayout.BLOCK_MAJOR, torch.float16, num_blocks=9, device="cuda",
                      block_size=3, heads=5, head_size=36)  # fmt: skip
    tuning = triton_exec.Tuning(tile_bytes=64)
    assert triton_exec.geometry(spec, tuning).tiles_per_chunk > 1
    before = snapshot(spec)
    plan = plan_zeroize([3, 8], spec.num_blocks)
    triton_exec.zero_blocks(spec, plan.block_ids, tuning)
    check_cleared(spec, before, plan)
    assert triton_exec.dirty_blocks(spec, list(range(9)), tuning) == [0, 1, 2, 4, 5, 6, 7]


def test_misaligned_layers_fall_back_to_byte_words() -> None:
    buffer = torch.randint(1, 256, (2 * 8 * 48 + 3,), dtype=torch.uint8, device="cuda")
    layers = [buffer[3:387].view(8, 48), buffer[387:].view(8, 48)]
    spec = KVCacheSpec.flat_bytes(layers)
    assert triton_exec.geometry(spec).word_bytes == 1
    before = snapshot(spec)
    plan = plan_zeroize([0, 7], spec.num_blocks)
    zeroize(spec, plan, verify="full")
    check_cleared(spec, before, plan)
    assert bool((buffer[:3] != 0).all())


def test_G3_stream_order_alone_protects_the_next_owner() -> None:
    """Zeroize right after a pending write on the engine's stream, with no host sync between: the
    clear must land after the write, and a read enqueued after it must see zeros."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=8, num_blocks=1024,
                      device="cuda", **REALISTIC)  # fmt: skip
    stream = torch.cuda.Stream()
    plan = plan_zeroize(range(0, 1024, 3), spec.num_blocks)
    with torch.cuda.stream(stream):
        for layer in spec.layers:
            torch.cuda._sleep(1_000_000)  # keep the stream busy so ordering matters
            layer.fill_(7)  # the previous owner's late write
    zeroize(spec, plan, stream=stream, verify="none")
    with torch.cuda.stream(stream):
        sums = torch.stack([seg[list(plan.block_ids)].sum(dtype=torch.int64)
                            for seg in spec.segment_views()])  # fmt: skip
    assert int(sums.sum().cpu()) == 0


def test_verify_detects_a_planted_byte_on_the_gpu() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.float8_e4m3fn, num_layers=4, num_blocks=64,
                      device="cuda", **REALISTIC)  # fmt: skip
    plan = plan_zeroize([3, 4, 60], spec.num_blocks)
    zeroize(spec, plan, verify="full")
    spec.layers[3][1, 60].view(-1).view(torch.uint8)[-1] = 1
    with pytest.raises(ZeroizeVerificationError, match="1 of 3 checked blocks"):
        verify_zeroized(spec, plan, "full")


def test_torch_path_on_the_gpu_matches() -> None:
    spec = make_cache(KVLayout.VLLM_CPU, torch.bfloat16, num_blocks=40, device="cuda", **REALISTIC)
    before = snapshot(spec)
    plan = plan_zeroize(range(0, 40, 2), spec.num_blocks)
    evidence = zeroize(spec, plan, verify="full", method="torch")
    assert evidence.method is Method.TORCH
    check_cleared(spec, before, plan)


# --- the asynchronous path (issue 14) --------------------------------------------------------------


@pytest.mark.parametrize("timed", [True, False])
@pytest.mark.parametrize("mode", ["none", "full"])
def test_zeroize_async_never_waits_for_queued_work(mode: str, timed: bool) -> None:
    """Behind ~50 ms of queued work the call returns at once; the verdict comes when it completes,
    whichever event marks the completion (the graph's last node: `done` untimed, the last timing
    event timed)."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=4, num_blocks=64,
                      device="cuda", **REALISTIC)  # fmt: skip
    zeroize(spec, plan_zeroize([0], spec.num_blocks), verify="full")  # compile outside the timing
    before = snapshot(spec)
    plan = plan_zeroize([3, 9, 10], spec.num_blocks)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    pending = zeroize_async(spec, plan, verify=mode, timed=timed)
    enqueue_s = time.perf_counter() - started
    assert not pending.poll()  # still queued behind the spin
    assert enqueue_s < 0.01, enqueue_s
    pending.wait()
    assert pending.ok
    evidence = pending.evidence()
    assert (evidence.device_time_us is not None) == timed
    assert (evidence.verify_time_us is not None) == (timed and mode == "full")
    check_cleared(spec, before, plan)
    staging = triton_exec.launcher(spec).staging._made[0]
    assert staging.graphs[(mode == "full", timed)]  # it went through a graph


@pytest.mark.parametrize("counts", [(16, 5, 1, 64, 33), (1, 16, 2048, 7)])
def test_the_compiled_fast_path_serves_every_count(counts: tuple[int, ...]) -> None:
    """The first call compiles; later ones reuse that kernel with any count (no specialization on
    1 or on multiples of 16 leaks into the fast path)."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=3, num_blocks=4096,
                      device="cuda", **IRREGULAR)  # fmt: skip
    chooser = random.Random(sum(counts))
    for count in counts:
        before = snapshot(spec)
        plan = plan_zeroize(chooser.sample(range(4096), count), spec.num_blocks)
        pending = zeroize_async(spec, plan, verify="full")
        pending.wait()
        assert pending.ok
        check_cleared(spec, before, plan)
        for layer in spec.layers:  # dirty again for the next round
            layer.view(-1).view(torch.uint8).random_(1, 256)
    assert triton_exec.launcher(spec)._ready  # the fast path was taken


def test_dirty_flags_come_back_through_pinned_memory() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.float8_e4m3fn, num_layers=2, num_blocks=100,
                      device="cuda", **REALISTIC)  # fmt: skip
    zeroize(spec, plan_zeroize([1], spec.num_blocks), verify="full")  # compiled
    launch = triton_exec.launcher(spec)
    launch.graphs_enabled = False  # so that the replaced `clear` is what runs
    launch.clear = lambda *_args, **_kw: None  # type: ignore[method-assign]
    try:
        pending = zeroize_async(spec, plan_zeroize([99, 3, 50], spec.num_blocks), verify="full")
        pending.wait()
        assert pending.dirty_ids == (3, 50, 99)
        with pytest.raises(ZeroizeVerificationError, match="3 of 3 checked blocks"):
            pending.evidence()
    finally:
        del launch.clear
        launch.graphs_enabled = True
    again = zeroize_async(spec, plan_zeroize([99, 3, 50], spec.num_blocks), verify="full")
    again.wait()
    assert again.ok  # the reused staging's flags were zeroed


def test_sample_mode_and_a_side_stream() -> None:
    spec = make_cache(KVLayout.BLOCK_MAJOR, torch.float16, num_layers=2, num_blocks=300,
                      device="cuda", **REALISTIC)  # fmt: skip
    before = snapshot(spec)
    stream = torch.cuda.Stream()
    plan = plan_zeroize(range(0, 300, 3), spec.num_blocks)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(5_000_000)  # type: ignore[no-untyped-call]
    pending = zeroize_async(spec, plan, stream=stream, verify="sample", sample_size=8, seed=1)
    pending.wait()
    evidence = pending.evidence()
    assert evidence.blocks_verified == 8 and evidence.verified
    torch.cuda.synchronize()
    check_cleared(spec, before, plan)


def test_step_zeroizer_on_the_gpu_reports_at_a_later_collect() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=4, num_blocks=256,
                      device="cuda", **REALISTIC)  # fmt: skip
    before = snapshot(spec)
    clears = StepZeroizer(spec)
    clears.submit(handover=[1, 2], release=[10, 11, 12], verify="sample")  # compiles
    clears.drain()
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
    clears.submit(handover=[3], release=[20, 21], verify="full")
    assert clears.collect() == [] and clears.pending == 2
    torch.cuda.synchronize()
    results = clears.collect()
    assert [(r.blocks, r.handover, r.ok) for r in results] == [((3,), True, True),
                                                                ((20, 21), False, True)]  # fmt: skip
    check_cleared(spec, before, plan_zeroize([1, 2, 3, 10, 11, 12, 20, 21], spec.num_blocks))


# --- the fast enqueue path (issue 14, item 2) -------------------------------------------------------


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "one-by-one"])
@pytest.mark.parametrize("host_ids_max", [64, 0], ids=["ids-in-place", "ids-copied"])
@pytest.mark.parametrize("mode", ["none", "sample", "full"])
def test_G2_the_fast_path_clears_exactly_the_plan(
    graphs: bool, host_ids_max: int, mode: str
) -> None:
    """Calls through per-staging CUDA graphs (or launched one by one), ids read from pinned host
    memory (up to 64) or copied to the device, across the boundary between the two, timed and
    untimed, with counts changing from call to call (graph nodes updated in place)."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=3, num_blocks=512,
                      device="cuda", **REALISTIC)  # fmt: skip
    launch = triton_exec.launcher(spec)
    launch.staging = StagingPool(spec.device, host_ids_max=host_ids_max)
    launch.graphs_enabled = graphs
    zeroize(spec, plan_zeroize([0], spec.num_blocks), verify="full")  # compiles both kernels
    assert (launch.graph_kernels(with_check=True) is not None) == graphs
    chooser = random.Random(host_ids_max)
    for count in (1, 16, 63, 64, 65, 200, 64, 1, 200):
        for timed in (True, False):
            before = snapshot(spec)
            plan = plan_zeroize(chooser.sample(range(512), count), spec.num_blocks)
            pending = zeroize_async(spec, plan, verify=mode, timed=timed)
            pending.wait()
            assert pending.ok
            evidence = pending.evidence()
            assert (evidence.device_time_us is not None) == timed
            assert (evidence.verify_time_us is not None) == (timed and mode != "none")
            check_cleared(spec, before, plan)
            for layer in spec.layers:
                layer.view(-1).view(torch.uint8).random_(1, 256)
    made = launch.staging._made
    assert {s.on_host for s in made} == ({True, False} if host_ids_max else {False})
    built = [graph for s in made for graph in s.graphs.values()]
    assert (len(built) > 0 and all(built)) if graphs else not built


def test_a_graph_the_driver_refuses_falls_back_to_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=2, num_blocks=64,
                      device="cuda", **REALISTIC)  # fmt: skip
    zeroize(spec, plan_zeroize([1], spec.num_blocks), verify="full")
    monkeypatch.setattr(_driver.Driver, "begin_capture", lambda *_args: 999)
    triton_exec.launcher(spec).staging = StagingPool(spec.device)
    before = snapshot(spec)
    plan = plan_zeroize([3, 30], spec.num_blocks)
    for _ in range(2):  # refused once, not tried again
        evidence = zeroize(spec, plan, verify="full")
        assert evidence.verified and evidence.device_time_us is not None
    check_cleared(spec, before, plan)
    staging = triton_exec.launcher(spec).staging._made[0]
    assert staging.graphs == {(True, True): None}


def test_untimed_calls_keep_the_verdict_and_say_timings_are_absent() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.float8_e4m3fn, num_layers=2, num_blocks=100,
                      device="cuda", **REALISTIC)  # fmt: skip
    zeroize(spec, plan_zeroize([1], spec.num_blocks), verify="full")  # compiled
    before = snapshot(spec)
    plan = plan_zeroize([5, 6, 70], spec.num_blocks)
    for mode in ("none", "full"):
        pending = zeroize_async(spec, plan, verify=mode, timed=False)
        pending.wait()
        evidence = pending.evidence()
        assert evidence.device_time_us is None and evidence.verify_time_us is None
    check_cleared(spec, before, plan)
    spec.layers[1][0, 70].view(-1).view(torch.uint8)[0] = 9
    launch = triton_exec.launcher(spec)
    launch.graphs_enabled = False
    launch.clear = lambda *_args, **_kw: None  # type: ignore[method-assign]
    try:
        pending = zeroize_async(spec, plan, verify="full", timed=False)
        pending.wait()
        assert pending.dirty_ids == (70,)  # a failed verdict is just as final untimed
    finally:
        del launch.clear
        launch.graphs_enabled = True


def test_a_thread_that_never_used_cuda_can_enqueue() -> None:
    """The driver calls need the device's context current on the calling thread: a fresh thread
    has none until kvguard binds it (only on that first failure)."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=2, num_blocks=64,
                      device="cuda", **REALISTIC)  # fmt: skip
    zeroize(spec, plan_zeroize([1], spec.num_blocks), verify="full")  # compiled here
    before = snapshot(spec)
    plan = plan_zeroize([2, 40], spec.num_blocks)
    outcome: list[object] = []

    def work() -> None:
        try:
            pending = zeroize_async(spec, plan, verify="full")
            pending.wait()
            outcome.append(pending.ok)
        except Exception as exc:  # reported to the main thread
            outcome.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert outcome == [True]
    check_cleared(spec, before, plan)


def test_the_kernels_read_ids_in_place_only_after_the_host_wrote_them() -> None:
    """Ids read from pinned memory at kernel time: each call's ids live in its own staging until it
    completes, so many calls in flight behind queued work never see another call's ids."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=2, num_blocks=1024,
                      device="cuda", **REALISTIC)  # fmt: skip
    zeroize(spec, plan_zeroize([1], spec.num_blocks), verify="full")
    before = snapshot(spec)
    chooser = random.Random(9)
    plans = [plan_zeroize(chooser.sample(range(1024), 8), spec.num_blocks) for _ in range(40)]
    torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
    pendings = [zeroize_async(spec, plan, verify="full") for plan in plans]
    torch.cuda.synchronize()
    assert all(p.poll() and p.ok for p in pendings)
    union = plan_zeroize([b for plan in plans for b in plan.block_ids], spec.num_blocks)
    check_cleared(spec, before, union)


def test_by_default_one_gpu_call_in_sixteen_is_timed_and_says_so() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=2, num_blocks=64,
                      device="cuda", **REALISTIC)  # fmt: skip
    timings = []
    for index in range(2 * TIMING_EVERY + 1):
        pending = zeroize_async(spec, plan_zeroize([index % 64], spec.num_blocks), verify="full")
        pending.wait()
        evidence = pending.evidence()
        assert evidence.verified  # every call is verified, timed or not
        timings.append(evidence.device_time_us is not None)
        assert (evidence.verify_time_us is not None) == timings[-1]
    assert [i for i, timed in enumerate(timings) if timed] == [0, TIMING_EVERY, 2 * TIMING_EVERY]
    assert zeroize(spec, plan_zeroize([5], spec.num_blocks)).device_time_us is not None


@pytest.mark.parametrize("method", [Method.TRITON, Method.TORCH])
def test_vllm_views_of_the_cuda_default_layout_are_cleared_exactly(method: Method) -> None:
    """vLLM 0.32 on CUDA views each layer of one backing buffer as `[B, H, N, C]` with LBNHC
    strides (not contiguous); `KVCacheSpec.vllm_views` clears each layer's dense block pages
    through byte views, on the GPU with both executors: the planned blocks of every layer, and not
    one other byte of the buffer (views built here as vLLM's `create_kv_cache_views` builds them)."""
    layers, blocks, heads, tokens, width = 4, 96, 8, 16, 128
    page = heads * tokens * width  # elements of one layer's block
    raw = torch.randint(1, 127, (2 * layers * blocks * page,), dtype=torch.int8, device="cuda")

    def views(buffer: torch.Tensor) -> list[torch.Tensor]:
        elements = buffer.view(torch.bfloat16)
        strides = (page, width, heads * width, 1)  # physical order B, N, H, C
        return [
            torch.as_strided(
                elements, (blocks, heads, tokens, width), strides, layer * blocks * page
            )
            for layer in range(layers)
        ]

    spec = KVCacheSpec.vllm_views(views(raw))
    assert spec.layout is KVLayout.FLAT_BYTES and spec.num_blocks == blocks
    ids = [0, 7, 8, 9, 50, blocks - 1]
    expected = raw.clone()
    for view in views(expected):
        view[ids] = 0
    evidence = zeroize(spec, plan_zeroize(ids, blocks), verify="full", method=method)
    assert evidence.verified and evidence.block_count == len(ids)
    assert torch.equal(raw, expected)
