"""Whole KV blocks as bytes: read out of and written into a paged KV cache (any kvguard layout).

A block's payload is its bytes in every segment (each layer's K and V, or its one segment), in the
spec's segment order, so a payload read from a cache is written back bit for bit into any block of
a cache with the same spec. Reads and writes run on the cache's device and its current stream; a
read returns host bytes, so on a GPU it waits for its device-to-host copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvguard.zeroize import KVCacheSpec


class BlockCopier:
    """Whole blocks (every layer, K and V) as bytes, out of and into a paged KV cache.

    Copies go through staging buffers made once and grown on demand: on the device, one gather per
    segment into a segment-major buffer and one transpose into block-major order; on the host, a
    pinned buffer (on a GPU), so each batch is a single device-to-host or host-to-device copy.
    """

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self._views = spec.segment_views()
        self.block_bytes = spec.bytes_per_block
        self._device = spec.device
        self._cuda = self._device.type == "cuda"
        self._out: _Staging | None = None
        self._in: _Staging | None = None
        self._in_copied: torch.cuda.Event | None = (
            None  # the last upload out of `_in`'s host buffer
        )

    def read(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Each block's bytes, in segment order. The views alias the staging buffer: its contents
        change with the next `read` (copy them first to keep them)."""
        n = len(block_ids)
        self._out = stage = _grow(self._out, n, self._views, self._cuda)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self._device)
        by_segment = stage.by_segment[:, :n]
        for s, view in enumerate(self._views):
            torch.index_select(view, 0, idx, out=by_segment[s])
        stage.by_block[:n].copy_(by_segment.transpose(0, 1))
        if self._cuda:
            stage.host[:n].copy_(stage.by_block[:n], non_blocking=True)
            torch.cuda.current_stream(self._device).synchronize()  # the bytes are needed now
        return [_view(stage.host[i]) for i in range(n)]

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]) -> None:
        """Copy each payload into its block (on the cache's current stream)."""
        n = len(block_ids)
        if self._in_copied is not None:  # the host buffer is reused: its last upload must be done
            self._in_copied.synchronize()
        self._in = stage = _grow(self._in, n, self._views, self._cuda)
        size = self.block_bytes
        for i, payload in enumerate(payloads):
            data = payload if isinstance(payload, bytes) else bytes(payload)
            if len(data) != size:
                raise ValueError(f"a block payload is {len(data)} bytes, the cache's blocks {size}")
            ctypes.memmove(stage.host[i].data_ptr(), data, size)  # one memcpy, no NumPy needed
        source = stage.host[:n]
        if self._cuda:
            stage.by_block[:n].copy_(source, non_blocking=True)
            self._in_copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._in_copied.record(torch.cuda.current_stream(self._device))
            source = stage.by_block[:n]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self._device)
        for s, view in enumerate(self._views):
            view.index_copy_(0, idx, source[:, s])


class _Staging:
    """`by_segment` [segments, capacity, chunk] and `by_block` [capacity, segments, chunk] on the
    cache's device; `host` [capacity, segments, chunk] (pinned on a GPU; `by_block` itself on CPU)."""

    def __init__(self, capacity: int, segments: int, chunk: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.capacity = capacity
        self.by_segment = torch.empty((segments, capacity, chunk), dtype=torch.uint8, device=device)
        self.by_block = torch.empty((capacity, segments, chunk), dtype=torch.uint8, device=device)
        self.host = (
            torch.empty((capacity, segments, chunk), dtype=torch.uint8, pin_memory=True)
            if cuda
            else self.by_block
        )


def _grow(stage: _Staging | None, n: int, views: list[torch.Tensor], cuda: bool) -> _Staging:
    if stage is not None and stage.capacity >= n:
        return stage
    if cuda:
        torch.cuda.current_stream(views[0].device).synchronize()  # nothing still reads the old one
    capacity = max(n, 2 * stage.capacity if stage is not None else 16)
    return _Staging(capacity, len(views), int(views[0].shape[1]), views[0].device)


def _view(row: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes as a memoryview (no copy; valid while the tensor lives)."""
    size = row.numel() * row.element_size()
    array = (ctypes.c_ubyte * size).from_address(row.data_ptr())
    array._tensor = row  # type: ignore[attr-defined]  # the view keeps the memory alive
    return memoryview(array).cast("B")
