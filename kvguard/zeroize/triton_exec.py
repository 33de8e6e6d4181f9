"""GPU executor: launch the Triton kernels of `_kernels` over a cache spec and a plan.

Triton is imported on first use, never at module import, so `import kvguard.zeroize` works on machines
without Triton or a GPU (`triton_available()` says whether this executor can run).

Stream order. Both launchers enqueue on `stream` (default: the current stream of the cache's device)
and never synchronize the device. The table upload is a stream-ordered copy on the same stream. So any
kernel enqueued later on that stream, such as the forward pass of the block's next owner, starts only
after every planned byte is zero; work on other streams needs the usual event wait, as for any write
to the cache.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvguard.errors import ZeroizeError
from kvguard.zeroize.layout import KVCacheSpec


@dataclass(frozen=True)
class Tuning:
    """Launch constants of one kernel; the defaults below come from a sweep (docs/zeroize.md)."""

    tile_bytes: int = 16384  # bytes per work item: four 128-bit accesses per thread at 8 warps
    programs_per_sm: int = 4  # persistent grid size, in programs per multiprocessor
    num_warps: int = 8


# Sweep on an H200 (2026-11-26; tiles 4-32 KiB x 2-16 programs/SM x 4/8 warps, Llama-3-8B cache,
# scattered ids): stores are fire-and-forget, so the clearing kernel is flat within noise
# (131.5-144 us for 256 blocks, 1013-1098 us for 2048) for every setting; the read-back must keep
# loads in flight and wants occupancy: at 16 KiB and 8 warps, 2 programs/SM took 148 us for 256
# blocks, 4 took 128 us, 8 took 125 us (932 us for 2048), 16 no better.
DEFAULT_TUNING = Tuning(tile_bytes=16384, programs_per_sm=4, num_warps=8)
DEFAULT_VERIFY_TUNING = Tuning(tile_bytes=16384, programs_per_sm=8, num_warps=8)
# Programs used when no GPU is present (the interpreter): small, so tests also exercise the stride.
_INTERPRETER_PROGRAMS = 3


@dataclass(frozen=True)
class _Geometry:
    """Compile-time constants for one cache shape, derived from the spec."""

    word_bytes: int
    align: int
    chunk_words: int
    tile: int
    tiles_per_chunk: int

    @property
    def even(self) -> bool:
        return self.chunk_words % self.tile == 0


def triton_available() -> bool:
    """True when Triton is installed (the kernels may still need a GPU or TRITON_INTERPRET=1)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or deliberately blocked install
        return False


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}


@functools.cache
def _kernel_module() -> ModuleType:
    if not triton_available():
        raise ZeroizeError(
            "the Triton executor needs the `triton` package (pip install kvguard[gpu])"
        )
    from kvguard.zeroize import _kernels  # noqa: PLC0415  (guarded import: Triton is optional)

    return _kernels


def check_runnable(spec: KVCacheSpec) -> None:
    """Raise ZeroizeError unless the Triton kernels can run on this cache's device."""
    if spec.device.type == "cuda" or (spec.device.type == "cpu" and interpreting()):
        _kernel_module()
        return
    raise ZeroizeError(
        f"the Triton executor needs a CUDA tensor (or CPU tensors under TRITON_INTERPRET=1), "
        f"got device {spec.device}; use method='torch'"
    )


def geometry(spec: KVCacheSpec, tuning: Tuning = DEFAULT_TUNING) -> _Geometry:
    """Word size, alignment and tiling for `spec`: the widest accesses its addresses allow."""
    align = 16
    for value in (spec.chunk_bytes, *spec.segment_addresses):
        align = math.gcd(align, value)  # a power of two <= 16 dividing every segment start
    word = min(align, 4)
    chunk_words = spec.chunk_bytes // word
    tile = min(1 << (chunk_words - 1).bit_length(), tuning.tile_bytes // word)
    return _Geometry(word, align, chunk_words, tile, -(-chunk_words // tile))


@contextlib.contextmanager
def on_stream(spec: KVCacheSpec, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make the cache's device and `stream` current (no-op for CPU tensors)."""
    if spec.device.type != "cuda":
        yield
        return
    with torch.cuda.device(spec.device):
        chosen = stream if stream is not None else torch.cuda.current_stream(spec.device)
        with torch.cuda.stream(chosen):
            yield


def _table(spec: KVCacheSpec, block_ids: Sequence[int]) -> torch.Tensor:
    # One upload for both parts. A non-blocking copy from pageable memory is staged by the driver at
    # call time, so the host list may die at once; the copy itself runs in stream order.
    host = torch.tensor([*spec.segment_addresses, *block_ids], dtype=torch.int64)
    return host.to(spec.device, non_blocking=True)


def _grid(spec: KVCacheSpec, num_work: int, tuning: Tuning) -> tuple[int]:
    if spec.device.type == "cuda":
        sms = torch.cuda.get_device_properties(spec.device).multi_processor_count
        return (max(1, min(num_work, sms * tuning.programs_per_sm)),)
    return (max(1, min(num_work, _INTERPRETER_PROGRAMS)),)


def _launch(
    kernel_name: str,
    spec: KVCacheSpec,
    block_ids: Sequence[int],
    extra: tuple[torch.Tensor, ...],
    tuning: Tuning,
) -> None:
    geo = geometry(spec, tuning)
    table = _table(spec, block_ids)
    num_work = spec.num_segments * len(block_ids) * geo.tiles_per_chunk
    kernel = getattr(_kernel_module(), kernel_name)
    kernel[_grid(spec, num_work, tuning)](
        table, *extra, spec.num_segments, len(block_ids), num_work,
        CHUNK_WORDS=geo.chunk_words, TILE=geo.tile, TILES_PER_CHUNK=geo.tiles_per_chunk,
        WORD_BYTES=geo.word_bytes, ALIGN=geo.align, EVEN=geo.even, num_warps=tuning.num_warps,
    )  # fmt: skip


def zero_blocks(
    spec: KVCacheSpec, block_ids: Sequence[int], tuning: Tuning = DEFAULT_TUNING
) -> None:
    """Enqueue one launch clearing `block_ids` in every segment, on the current stream."""
    if block_ids:
        _launch("zero_blocks_kernel", spec, block_ids, (), tuning)


def dirty_flags(
    spec: KVCacheSpec, block_ids: Sequence[int], tuning: Tuning = DEFAULT_VERIFY_TUNING
) -> torch.Tensor:
    """Enqueue the read-back: an int32 flag per id, 1 where any byte is non-zero. Does not wait."""
    flags = torch.zeros(len(block_ids), dtype=torch.int32, device=spec.device)
    if block_ids:
        _launch("dirty_blocks_kernel", spec, block_ids, (flags,), tuning)
    return flags


def dirty_blocks(
    spec: KVCacheSpec, block_ids: Sequence[int], tuning: Tuning = DEFAULT_VERIFY_TUNING
) -> list[int]:
    """Ids among `block_ids` with any non-zero byte in any segment (one launch, then a read-back)."""
    if not block_ids:
        return []
    flags = dirty_flags(spec, block_ids, tuning)
    # `.tolist()` copies on the current stream and waits for it: the read-back sees the kernel's work.
    return [block for block, flag in zip(block_ids, flags.tolist(), strict=True) if flag]
