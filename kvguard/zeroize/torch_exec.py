"""Torch executor: clear and check planned blocks with plain tensor ops (any device, no Triton).

The path used on CPU caches (vLLM's CPU backend, HF transformers) and wherever Triton is missing. It
works on the same `[num_blocks, chunk_bytes]` byte views of each segment as the kernel, so it covers
every layout and dtype alike. On a CUDA tensor its ops run on the current stream, so the stream-order
guarantee of `triton_exec` holds here too; it only takes more launches.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.plan import BlockRun

# Up to this many runs, one `zero_()` per run and segment (a memset each); past it one `index_fill_`
# per segment, so a plan of thousands of scattered ids costs one op per segment, not one per id.
MAX_SLICED_RUNS = 16
# Rows gathered at once when checking many blocks: bounds the temporary copy to 1024 blocks' bytes.
_CHECK_BATCH = 1024


def int64_tensor(*parts: Sequence[int]) -> torch.Tensor:
    """A CPU int64 tensor of the concatenated parts.

    Through `array` and `frombuffer` rather than `torch.tensor(list)`: 98 vs 168 us for 2,208 ids on
    the CI machine (2026-11-26), the largest host cost of a scattered release on this path.
    """
    words = array.array("q")
    for part in parts:
        words.extend(part)
    if not words:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(words, dtype=torch.int64)


def zero_blocks(spec: KVCacheSpec, runs: Sequence[BlockRun], block_ids: Sequence[int]) -> None:
    """Clear the planned blocks of every segment."""
    if not block_ids:
        return
    segments = spec.segment_views()
    if len(runs) <= MAX_SLICED_RUNS:
        for segment in segments:
            for start, length in runs:
                segment[start : start + length].zero_()
        return
    index = int64_tensor(block_ids).to(spec.device, non_blocking=True)
    for segment in segments:
        segment.index_fill_(0, index, 0)


def dirty_blocks(spec: KVCacheSpec, block_ids: Sequence[int]) -> list[int]:
    """Ids among `block_ids` with any non-zero byte in any segment (a reduction per segment)."""
    if not block_ids:
        return []
    index = int64_tensor(block_ids).to(spec.device, non_blocking=True)
    flags: list[torch.Tensor] = []
    for segment in spec.segment_views():
        rows = _words(segment)
        flags.extend(
            rows.index_select(0, index[first : first + _CHECK_BATCH]).any(dim=1).bool()
            for first in range(0, len(block_ids), _CHECK_BATCH)
        )
    per_segment = len(flags) // len(spec.segment_views())
    found = torch.stack(
        [torch.cat(flags[i : i + per_segment]) for i in range(0, len(flags), per_segment)]
    ).any(dim=0)
    return [block for block, flag in zip(block_ids, found.tolist(), strict=True) if flag]


def _words(segment: torch.Tensor) -> torch.Tensor:
    """The segment's rows as 64-bit words when they divide evenly (any non-zero byte makes its word
    non-zero): an eighth of the elements to reduce. On the CPU this took the read-back of 4 blocks
    of two 16 KiB segments from 871 us (uint8 `any`, which also crossed torch's threading grain) to
    41 us (torch 2.13, the CI VM, 2026-11-26)."""
    if segment.shape[-1] % 8 == 0:
        try:
            return segment.view(torch.int64)
        except RuntimeError:  # an offset or stride that does not allow it: check the bytes
            pass
    return segment
