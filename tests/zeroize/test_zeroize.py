"""zeroize / verify_zeroized on the torch path (CPU): every layout and dtype, sentinels, evidence."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import pytest
import torch

from kvguard.errors import BlockIdError, ZeroizeError, ZeroizeVerificationError
from kvguard.zeroize import (
    KVLayout,
    Method,
    VerifyMode,
    backend,
    plan_zeroize,
    torch_exec,
    verify_zeroized,
    zeroize,
)
from tests.zeroize.factories import check_cleared, layout_dtype_cases, make_cache, snapshot

FIXED = datetime(2026, 11, 26, 3, 0, tzinfo=UTC)


@pytest.mark.parametrize(("layout", "dtype"), layout_dtype_cases())
def test_G2_zeroize_clears_planned_blocks_and_nothing_else(
    layout: KVLayout, dtype: torch.dtype
) -> None:
    spec = make_cache(layout, dtype, num_layers=3, num_blocks=11)
    before = snapshot(spec)
    plan = plan_zeroize([0, 4, 5, 6, 10, 4], spec.num_blocks)  # both edges, a run, a duplicate
    evidence = zeroize(spec, plan, verify="full", method="torch", clock=lambda: FIXED)
    check_cleared(spec, before, plan)
    assert evidence.verified
    assert evidence.blocks_verified == 5
    assert evidence.bytes_cleared == 5 * spec.bytes_per_block
    assert evidence.method is Method.TORCH


@pytest.mark.parametrize("count", [1, 17, 40])
def test_scattered_plans_use_index_fill_and_stay_exact(count: int) -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_blocks=97, block_size=2)
    before = snapshot(spec)
    plan = plan_zeroize(range(1, 2 * count, 2), spec.num_blocks)  # no two ids adjacent
    assert len(plan.runs) == count  # above MAX_SLICED_RUNS the torch path switches to index_fill_
    zeroize(spec, plan, verify="full", method="torch")
    check_cleared(spec, before, plan)


@pytest.mark.parametrize(
    "sizes",
    [
        {"num_blocks": 1, "block_size": 1, "heads": 1, "head_size": 1},
        {"num_blocks": 13, "block_size": 7, "heads": 3, "head_size": 11},
        {"num_blocks": 5, "block_size": 16, "heads": 8, "head_size": 128},
    ],
)
def test_irregular_sizes(sizes: dict[str, int]) -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.float8_e5m2, **sizes)
    before = snapshot(spec)
    plan = plan_zeroize([spec.num_blocks - 1], spec.num_blocks)
    zeroize(spec, plan, verify="full", method="torch")
    check_cleared(spec, before, plan)


def test_empty_plan_touches_nothing_and_says_so() -> None:
    spec = make_cache(KVLayout.BLOCK_MAJOR, torch.float16)
    before = snapshot(spec)
    evidence = zeroize(spec, plan_zeroize([], spec.num_blocks), verify="full")
    check_cleared(spec, before, plan_zeroize([], spec.num_blocks))
    assert (evidence.block_count, evidence.bytes_cleared, evidence.blocks_verified) == (0, 0, 0)
    assert evidence.verified is None and evidence.device_time_us is None


def test_out_of_range_ids_never_reach_an_executor() -> None:
    spec = make_cache(KVLayout.MLA, torch.bfloat16, num_blocks=4)
    with pytest.raises(BlockIdError):
        plan_zeroize([4], spec.num_blocks)


def test_a_plan_for_another_cache_size_is_refused() -> None:
    spec = make_cache(KVLayout.MLA, torch.bfloat16, num_blocks=4)
    with pytest.raises(ZeroizeError, match="made for a cache of 8 blocks"):
        zeroize(spec, plan_zeroize([1], 8))
    with pytest.raises(ZeroizeError, match="ZeroizePlan"):
        zeroize(spec, [1])  # type: ignore[arg-type]


def test_bad_modes_and_methods_are_refused() -> None:
    spec = make_cache(KVLayout.MLA, torch.bfloat16, num_blocks=4)
    plan = plan_zeroize([1], 4)
    with pytest.raises(ZeroizeError, match="verify must be"):
        zeroize(spec, plan, verify="most")
    with pytest.raises(ZeroizeError, match="method must be"):
        zeroize(spec, plan, method="cuda")  # type: ignore[arg-type]
    with pytest.raises(ZeroizeError, match="sample_size"):
        zeroize(spec, plan, verify="sample", sample_size=0)


def test_auto_picks_torch_without_a_gpu() -> None:
    spec = make_cache(KVLayout.VLLM_CPU, torch.bfloat16)
    assert backend.resolve_method(spec, "auto") is Method.TORCH


def test_verify_detects_a_planted_nonzero_byte() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=4, num_blocks=9)
    plan = plan_zeroize([2, 3, 7], spec.num_blocks)
    zeroize(spec, plan, verify="full", method="torch")
    verify_zeroized(spec, plan, "full")
    # One byte, last layer, V half, last byte of block 7: the far corner of the plan.
    spec.layers[-1][1, 7].view(-1).view(torch.uint8)[-1] = 1
    with pytest.raises(ZeroizeVerificationError, match="1 of 3 checked blocks") as caught:
        verify_zeroized(spec, plan, "full")
    assert "[7]" in str(caught.value)
    # A sample that holds block 7 finds it; one that cannot (sample of the clean blocks) passes.
    with pytest.raises(ZeroizeVerificationError):
        verify_zeroized(spec, plan, "sample", sample_size=3, seed=1)
    verify_zeroized(spec, plan.subset([2, 3]), "full")


def test_G2_a_skipped_clear_is_never_reported_as_success(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_cache(KVLayout.MLA, torch.float8_e4m3fn, num_blocks=6)
    monkeypatch.setattr(torch_exec, "zero_blocks", lambda *_args: None)
    with pytest.raises(ZeroizeVerificationError, match="2 of 2 checked blocks"):
        zeroize(spec, plan_zeroize([1, 4], spec.num_blocks), verify="full", method="torch")


def test_sample_is_seeded_and_bounded() -> None:
    spec = make_cache(KVLayout.MLA, torch.int8, num_blocks=64)
    plan = plan_zeroize(range(0, 64, 2), spec.num_blocks)
    first = zeroize(spec, plan, verify="sample", sample_size=5, seed=7)
    assert first.blocks_verified == 5
    assert verify_zeroized(spec, plan, "sample", sample_size=5, seed=7).blocks_checked == 5
    assert verify_zeroized(spec, plan, "sample", sample_size=99).blocks_checked == 32
    assert verify_zeroized(spec, plan, VerifyMode.NONE).blocks_checked == 0
    unchecked = zeroize(spec, plan, verify="none")
    assert (unchecked.blocks_verified, unchecked.verified) == (0, None)  # never a vacuous True


def test_evidence_is_ledger_ready_and_carries_no_payload() -> None:
    pytest.importorskip("structlog")  # kvguard.logging needs it; GPU hosts may run without
    from kvguard.logging import is_sensitive_name  # noqa: PLC0415

    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_blocks=8)
    plan = plan_zeroize([1, 2, 6], spec.num_blocks)
    evidence = zeroize(spec, plan, verify="sample", seed=3, clock=lambda: FIXED)
    details = evidence.as_audit_details()
    assert details["block_count"] == 3
    assert details["block_ids_sha256"] == plan.block_ids_digest()
    assert details["started_at"] == "2026-11-26T03:00:00+00:00"
    assert details["device"] == "cpu"
    assert details["device_time_us"] is None  # no CUDA events off the GPU
    for name, value in details.items():
        assert not is_sensitive_name(name), name
        assert value is None or isinstance(value, str | int | float | bool)
        assert not isinstance(value, str) or len(value) <= 100


def test_evidence_fits_the_audit_event_schema() -> None:
    events = pytest.importorskip("kvguard.audit.events")
    spec = make_cache(KVLayout.MLA, torch.bfloat16, num_blocks=8)
    plan = plan_zeroize([5, 1], spec.num_blocks)
    evidence = zeroize(spec, plan, verify="full", clock=lambda: FIXED)
    event = events.AuditEvent(
        kind="block.zeroize",
        scope_tag="st_test",
        request_id="req-1",
        block_ids=list(plan.block_ids),
        details=evidence.as_audit_details(),
        ts=evidence.timestamp,
    )
    assert event.details["verified"] is True


def test_import_needs_neither_triton_nor_cuda() -> None:
    code = (
        "import os, sys\n"
        "sys.modules['triton'] = None\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch, kvguard.zeroize as z\n"
        "from kvguard.errors import ZeroizeError\n"
        "assert not z.triton_available()\n"
        "spec = z.KVCacheSpec.mla([torch.ones(4, 2, 3)])\n"
        "ev = z.zeroize(spec, z.plan_zeroize([1], 4), verify='full')\n"
        "assert ev.method == 'torch' and ev.verified\n"
        "try:\n"
        "    z.zeroize(spec, z.plan_zeroize([1], 4), method='triton')\n"
        "except ZeroizeError as exc:\n"
        "    print('refused:', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "refused: the Triton executor needs the `triton` package" in result.stdout


@pytest.mark.parametrize("layout", [KVLayout.VLLM_CPU, KVLayout.VLLM_FLASH, KVLayout.FLAT_BYTES])
@pytest.mark.parametrize("even", [True, False])
def test_the_read_back_finds_one_byte_anywhere_in_a_block(layout: KVLayout, even: bool) -> None:
    """The torch read-back reduces 64-bit words when a block's bytes divide into them (`even`), bytes
    otherwise: either way a single non-zero byte at any offset of any segment is found."""
    size = {"block_size": 4, "heads": 2, "head_size": 8} if even else {"heads": 1, "head_size": 5}
    dtype = torch.uint8 if layout is KVLayout.FLAT_BYTES else torch.bfloat16
    spec = make_cache(layout, dtype, num_blocks=6, **size)
    plan = plan_zeroize(range(6), spec.num_blocks)
    zeroize(spec, plan, verify="full", method="torch")
    segments = spec.segment_views()
    assert (segments[0].shape[1] % 8 == 0) is even
    chunk = segments[0].shape[1]
    for index, segment in enumerate(segments):
        for offset in sorted({0, 1, 7, 8 % chunk, chunk // 2, chunk - 1}):
            segment[4, offset] = 0x80
            assert torch_exec.dirty_blocks(spec, [1, 4, 5]) == [4], (index, offset)
            segment[4, offset] = 0
            assert torch_exec.dirty_blocks(spec, [1, 4, 5]) == []


@pytest.mark.parametrize("ids", [(5,), (0, 4), (-1,), (3, 1, 9)])
def test_a_hand_built_plan_outside_the_cache_is_refused(ids: tuple[int, ...]) -> None:
    """A `ZeroizePlan` built by hand, not by `plan_zeroize`: an id past the cache made the Triton
    kernel clear the memory after the layer tensor, and the torch path clear nothing while its
    evidence counted the block (found by a review). Refused before anything is cleared."""
    from kvguard.zeroize import ZeroizePlan  # noqa: PLC0415

    spec = make_cache(KVLayout.VLLM_CPU, torch.float16, num_blocks=4)
    before = snapshot(spec)
    with pytest.raises(ZeroizeError, match="outside the cache"):
        zeroize(spec, ZeroizePlan(4, ids), verify="none")
    after = snapshot(spec)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
