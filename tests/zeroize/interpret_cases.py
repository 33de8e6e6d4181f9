"""The Triton kernels on CPU tensors, run as `TRITON_INTERPRET=1 python -m tests.zeroize.interpret_cases`.

A separate process because Triton decides at decoration time whether a kernel is compiled or
interpreted: setting the variable inside the pytest process would either come too late or leak into
other tests. Prints one JSON object mapping each case name to "ok" or the failure text.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch

from kvguard.errors import ZeroizeVerificationError
from kvguard.zeroize import (
    KVCacheSpec,
    KVLayout,
    plan_zeroize,
    triton_exec,
    zeroize,
    zeroize_async,
)
from tests.zeroize.factories import check_cleared, layout_dtype_cases, make_cache, snapshot

Case = Callable[[], None]


def _layout_case(layout: KVLayout, dtype: torch.dtype) -> Case:
    def run() -> None:
        spec = make_cache(layout, dtype, num_layers=2, num_blocks=7, seed=len(str(dtype)))
        before = snapshot(spec)
        plan = plan_zeroize([0, 2, 3, 6], spec.num_blocks)
        evidence = zeroize(spec, plan, verify="full", method="triton")
        assert evidence.method == "triton" and evidence.verified
        check_cleared(spec, before, plan)

    return run


def _multi_tile_case(tile_bytes: int, head_size: int) -> Case:
    """Chunks split over several tiles, the last one partial (the masked path)."""

    def run() -> None:
        spec = make_cache(KVLayout.VLLM_FLASH, torch.float16, num_blocks=5, head_size=head_size)
        tuning = triton_exec.Tuning(tile_bytes=tile_bytes)
        geo = triton_exec.geometry(spec, tuning)
        assert geo.tiles_per_chunk > 1, geo
        before = snapshot(spec)
        plan = plan_zeroize([1, 4], spec.num_blocks)
        triton_exec.zero_blocks(spec, plan.block_ids, tuning)
        check_cleared(spec, before, plan)
        assert triton_exec.dirty_blocks(spec, list(range(5)), tuning) == [0, 2, 3]

    return run


def _misaligned_case() -> None:
    """Layers that start one byte into a buffer: only single-byte words are safe there."""
    buffer = torch.randint(1, 256, (2 * 6 * 10 + 1,), dtype=torch.uint8)
    layers = [buffer[1:61].view(6, 10), buffer[61:].view(6, 10)]
    spec = KVCacheSpec.flat_bytes(layers)
    assert triton_exec.geometry(spec).word_bytes == 1
    before = snapshot(spec)
    plan = plan_zeroize([5, 0], spec.num_blocks)
    zeroize(spec, plan, verify="full", method="triton")
    check_cleared(spec, before, plan)
    assert buffer[0] != 0


def _planted_byte_case() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=3, num_blocks=6)
    plan = plan_zeroize([1, 2, 5], spec.num_blocks)
    zeroize(spec, plan, verify="full", method="triton")
    spec.layers[2][1, 5].view(-1).view(torch.uint8)[-1] = 9  # last layer, V half, last byte
    assert triton_exec.dirty_blocks(spec, list(plan.block_ids)) == [5]


def _empty_plan_case() -> None:
    spec = make_cache(KVLayout.MLA, torch.float8_e5m2, num_blocks=3)
    before = snapshot(spec)
    evidence = zeroize(spec, plan_zeroize([], 3), verify="full", method="triton")
    assert evidence.block_count == 0
    check_cleared(spec, before, plan_zeroize([], 3))


def _async_sample_case() -> None:
    """The staged path with a sample checked from its own ids (after the plan's, one upload)."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_layers=2, num_blocks=30)
    before = snapshot(spec)
    plan = plan_zeroize(range(0, 30, 2), spec.num_blocks)
    pending = zeroize_async(spec, plan, verify="sample", sample_size=4, seed=3, method="triton")
    assert pending.poll() and pending.ok
    evidence = pending.evidence()
    assert (evidence.method, evidence.blocks_verified, evidence.verified) == ("triton", 4, True)
    check_cleared(spec, before, plan)


def _async_dirty_case() -> None:
    """A skipped clear comes back as dirty flags written by the read-back kernel, with the ids."""
    spec = make_cache(KVLayout.VLLM_CPU, torch.float16, num_blocks=9)
    launch = triton_exec.launcher(spec)
    launch.clear = lambda *_args, **_kw: None  # type: ignore[method-assign]
    pending = zeroize_async(spec, plan_zeroize([8, 2, 5], 9), verify="full", method="triton")
    assert pending.poll() and not pending.ok and pending.dirty_ids == (2, 5, 8)
    try:
        pending.evidence()
    except ZeroizeVerificationError:
        pass
    else:
        raise AssertionError("a dirty verdict must raise")


def _staging_reuse_case() -> None:
    """A completed call's buffers go back to the pool and serve the next call, flags zeroed first."""
    spec = make_cache(KVLayout.MLA, torch.bfloat16, num_blocks=10)
    launch = triton_exec.launcher(spec)
    pool = launch.staging
    launch.clear = lambda *_args, **_kw: None  # type: ignore[method-assign]
    first = zeroize_async(spec, plan_zeroize([1, 4], 10), verify="full", method="triton")
    assert pool.free_count() == 0 and first.poll() and first.dirty_ids == (1, 4)
    assert pool.free_count() == 1
    del launch.clear  # the class's method again
    second = zeroize_async(spec, plan_zeroize([1, 4], 10), verify="full", method="triton")
    assert pool.free_count() == 0 and second.poll() and second.ok and pool.free_count() == 1


def _low_address_buffer(size: int) -> int | None:
    """Anonymous memory mapped below 2**31 (None if no such address is free here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    fixed_noreplace, anonymous_private, read_write = 0x100000, 0x22, 0x3
    for hint in (0x30000000, 0x50000000, 0x10000000):
        address = libc.mmap(hint, size, read_write, anonymous_private | fixed_noreplace, -1, 0)
        if address == hint:
            return int(address)
    return None


def _low_addresses_case() -> None:
    """Ids and flags at addresses below 2**31, which Triton types as i32 (a non-PIE Python's heap):
    the kernels widen them before use."""
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_blocks=8)
    base = _low_address_buffer(4096)
    if base is None:
        return  # nothing to prove on this machine
    ids = torch.frombuffer((ctypes.c_int64 * 3).from_address(base), dtype=torch.int64)
    flags = torch.frombuffer((ctypes.c_int32 * 3).from_address(base + 1024), dtype=torch.int32)
    ids.copy_(torch.tensor([1, 4, 6]))
    launch = triton_exec.launcher(spec)
    launch.clear(base, 2, None)  # blocks 1 and 4
    flags.zero_()
    launch.check(base, 3, base + 1024, None)
    assert flags.tolist() == [0, 0, 1], flags.tolist()


def cases() -> dict[str, Case]:
    named: dict[str, Case] = {
        f"{layout}-{str(dtype).removeprefix('torch.')}": _layout_case(layout, dtype)
        for layout, dtype in layout_dtype_cases()
    }
    named["multi_tile_even"] = _multi_tile_case(tile_bytes=16, head_size=8)
    named["multi_tile_masked"] = _multi_tile_case(tile_bytes=32, head_size=5)
    named["misaligned_bytes"] = _misaligned_case
    named["planted_byte"] = _planted_byte_case
    named["empty_plan"] = _empty_plan_case
    named["async_sample"] = _async_sample_case
    named["async_dirty"] = _async_dirty_case
    named["staging_reuse"] = _staging_reuse_case
    named["low_addresses"] = _low_addresses_case
    return named


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 first", file=sys.stderr)
        return 2
    results: dict[str, str] = {}
    for name, case in cases().items():
        try:
            case()
            results[name] = "ok"
        except Exception:  # report every case, not only the first failure
            results[name] = traceback.format_exc(limit=4)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
