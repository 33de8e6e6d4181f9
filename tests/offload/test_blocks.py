"""Whole blocks out of and into a paged KV cache (the offload tier's copies), on every layout and on
the GPU when there is one: a payload written back is bit-exact and touches only its block."""

from __future__ import annotations

import pytest
import torch

from kvguard.offload.blocks import BlockCopier
from kvguard.zeroize import KVCacheSpec

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
LAYOUTS = {
    "vllm_flash": (KVCacheSpec.vllm_flash, lambda n: (2, n, 16, 2, 8)),
    "vllm_cpu": (KVCacheSpec.vllm_cpu, lambda n: (n, 2, 16, 16)),
    "block_major": (KVCacheSpec.block_major, lambda n: (n, 2, 16, 2, 8)),
    "mla": (KVCacheSpec.mla, lambda n: (n, 16, 24)),
}
NUM_BLOCKS = 12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_blocks_round_trip_bit_exact(device: str, layout: str, dtype: torch.dtype) -> None:
    build, shape = LAYOUTS[layout]
    g = torch.Generator().manual_seed(7)
    layers = [torch.randn(shape(NUM_BLOCKS), generator=g).to(dtype).to(device) for _ in range(3)]
    spec = build(layers)
    copier = BlockCopier(spec)
    payloads = copier.read([2, 5])
    assert [len(p) for p in payloads] == [spec.bytes_per_block] * 2
    snapshot = [layer.clone() for layer in layers]
    copier.write([9, 0], payloads)  # 2 -> 9, 5 -> 0
    views, old = spec.segment_views(), build(snapshot).segment_views()
    for view, before in zip(views, old, strict=True):
        assert torch.equal(view[9], before[2]) and torch.equal(view[0], before[5])
        others = [b for b in range(NUM_BLOCKS) if b not in (0, 9)]
        assert torch.equal(view[others], before[others])  # nothing else was touched


def test_a_payload_is_the_blocks_bytes_in_segment_order() -> None:
    layers = [torch.arange(4 * 8, dtype=torch.int16).view(4, 1, 2, 4) + 100 * i for i in range(2)]
    spec = KVCacheSpec.vllm_cpu([layer.to(torch.bfloat16) for layer in layers])
    (payload,) = BlockCopier(spec).read([1])
    expected = b"".join(view[1].cpu().numpy().tobytes() for view in spec.segment_views())
    assert payload == expected
