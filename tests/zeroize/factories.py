"""Cache factories and byte-level checks shared by the CPU, interpreter and GPU tests.

Caches are filled with random bytes that are never zero, so a byte an executor missed is always
visible, and every check compares raw bytes (a float compare would let -0.0 pass as zero).
"""

from __future__ import annotations

import torch

from kvguard.zeroize import KVCacheSpec, KVLayout, ZeroizePlan

ALL_DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
)
BYTE_DTYPES = (torch.int8, torch.uint8)


def layout_dtype_cases() -> list[tuple[KVLayout, torch.dtype]]:
    """Every supported (layout, dtype) pair: flat byte views only come as int8/uint8."""
    return [
        (layout, dtype)
        for layout in KVLayout
        for dtype in (BYTE_DTYPES if layout is KVLayout.FLAT_BYTES else ALL_DTYPES)
    ]


def layer_shape(
    layout: KVLayout, num_blocks: int, block_size: int, heads: int, head_size: int
) -> tuple[int, ...]:
    if layout is KVLayout.VLLM_FLASH:
        return (2, num_blocks, block_size, heads, head_size)
    if layout is KVLayout.VLLM_CPU:
        return (num_blocks, heads, block_size, 2 * head_size)
    if layout is KVLayout.BLOCK_MAJOR:
        return (num_blocks, 2, block_size, heads, head_size)
    if layout is KVLayout.MLA:
        return (num_blocks, block_size, head_size)
    return (num_blocks, 2 * block_size * heads * head_size)


def make_cache(
    layout: KVLayout,
    dtype: torch.dtype,
    *,
    num_layers: int = 2,
    num_blocks: int = 9,
    block_size: int = 3,
    heads: int = 2,
    head_size: int = 5,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> KVCacheSpec:
    """A cache of random, never-zero bytes. Odd sizes by default: nothing divides nicely."""
    generator = torch.Generator().manual_seed(seed)
    shape = layer_shape(layout, num_blocks, block_size, heads, head_size)
    layers = []
    for _ in range(num_layers):
        tensor = torch.empty(shape, dtype=dtype)
        raw = tensor.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(1, 256, raw.shape, generator=generator, dtype=torch.uint8))
        layers.append(tensor.to(device))
    return KVCacheSpec.from_layout(layout, layers)


def snapshot(spec: KVCacheSpec) -> list[torch.Tensor]:
    """Each segment's bytes, copied to the CPU."""
    return [view.cpu().clone() for view in spec.segment_views()]


def check_cleared(spec: KVCacheSpec, before: list[torch.Tensor], plan: ZeroizePlan) -> None:
    """Planned blocks are all-zero in every segment; every other byte is as it was."""
    planned = torch.zeros(spec.num_blocks, dtype=torch.bool)
    planned[list(plan.block_ids)] = True
    for index, (view, old) in enumerate(zip(spec.segment_views(), before, strict=True)):
        now = view.cpu()
        assert not now[planned].any(), f"segment {index}: a planned block still holds data"
        assert torch.equal(now[~planned], old[~planned]), f"segment {index}: a neighbour changed"
