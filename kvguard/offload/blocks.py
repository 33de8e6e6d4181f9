"""Whole KV blocks as bytes: read out of and written into a paged KV cache (any kvguard layout).

A block's payload is its bytes in every segment (each layer's K and V, or its one segment), in the
spec's segment order, so a payload read from a cache is written back bit for bit into any block of
a cache with the same spec. Reads and writes run on the cache's device and its current stream; a
read returns host bytes, so on a GPU it waits for its device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvguard.zeroize import KVCacheSpec


class BlockCopier:
    """Whole blocks (every layer, K and V) as bytes, out of and into a paged KV cache."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self._views = spec.segment_views()
        self.block_bytes = spec.bytes_per_block

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.spec.device)
        rows = torch.stack([v.index_select(0, idx) for v in self._views], dim=1).cpu()
        flat = rows.reshape(len(block_ids), -1).numpy()
        return [flat[i].tobytes() for i in range(len(block_ids))]

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        n, segments = len(block_ids), len(self._views)
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        rows = data.view(n, segments, -1).to(self.spec.device)
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.spec.device)
        for s, view in enumerate(self._views):
            view.index_copy_(0, idx, rows[:, s])
