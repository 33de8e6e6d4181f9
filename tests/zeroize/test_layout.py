"""KVCacheSpec: every layout and dtype is described right; anything else is refused with a reason."""

from __future__ import annotations

import pytest
import torch

from kvguard.errors import CacheLayoutError
from kvguard.zeroize import KVCacheSpec, KVLayout
from tests.zeroize.factories import layer_shape, layout_dtype_cases, make_cache


@pytest.mark.parametrize(("layout", "dtype"), layout_dtype_cases())
def test_geometry_matches_the_layout(layout: KVLayout, dtype: torch.dtype) -> None:
    spec = make_cache(layout, dtype, num_layers=3, num_blocks=7)
    element = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * 3 * 2 * 5 * element  # K and V (or 2*head_size), block 3, heads 2, head 5
    if layout is KVLayout.MLA:
        per_block = 3 * 5 * element
    assert spec.num_blocks == 7
    assert spec.num_layers == 3
    assert spec.bytes_per_block == 3 * per_block
    assert spec.chunks_per_block == (2 if layout is KVLayout.VLLM_FLASH else 1)
    assert spec.chunk_bytes * spec.chunks_per_block == per_block
    assert len(spec.segment_views()) == spec.num_segments == 3 * spec.chunks_per_block


def test_flash_segments_are_the_k_and_v_halves() -> None:
    layer = torch.arange(2 * 4 * 6, dtype=torch.int8).view(2, 4, 1, 2, 3)
    spec = KVCacheSpec.vllm_flash([layer])
    k_view, v_view = spec.segment_views()
    assert torch.equal(k_view[1], layer[0, 1].reshape(-1).view(torch.uint8))
    assert torch.equal(v_view[3], layer[1, 3].reshape(-1).view(torch.uint8))
    base = layer.data_ptr()
    assert spec.segment_addresses == (base, base + 4 * 6)


def test_mapping_input_keeps_order_and_drops_shared_layers() -> None:
    shared = torch.ones(4, 2, 3, dtype=torch.float16)
    other = torch.ones(4, 2, 3, dtype=torch.float16)
    spec = KVCacheSpec.mla({"layers.0": shared, "layers.1": shared, "layers.2": other})
    assert spec.layers == (shared, other)


@pytest.mark.parametrize(
    ("layout", "shape", "message"),
    [
        (KVLayout.VLLM_FLASH, (3, 4, 2, 2, 8), "dimension 0 must be 2"),
        (KVLayout.BLOCK_MAJOR, (4, 3, 2, 2, 8), "dimension 1 must be 2"),
        (KVLayout.VLLM_CPU, (4, 2, 2, 7), "2 \\* head_size"),
        (KVLayout.MLA, (4, 2, 2, 8), "expected 3 dimensions"),
        (KVLayout.VLLM_FLASH, (2, 0, 2, 2, 8), "no blocks"),
    ],
)
def test_wrong_shapes_are_refused(layout: KVLayout, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(CacheLayoutError, match=message):
        KVCacheSpec.from_layout(layout, [torch.ones(shape, dtype=torch.bfloat16)])


def test_non_contiguous_tensor_is_refused_with_the_expected_layout() -> None:
    permuted = torch.ones(2, 4, 2, 8, 3).permute(0, 1, 2, 4, 3)  # a head-major view
    with pytest.raises(CacheLayoutError, match=r"expected a contiguous tensor .*num_blocks"):
        KVCacheSpec.vllm_flash([permuted])


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.bool, torch.int32])
def test_unsupported_dtypes_are_refused(dtype: torch.dtype) -> None:
    with pytest.raises(CacheLayoutError, match="is not supported; expected one of"):
        KVCacheSpec.mla([torch.zeros(4, 2, 3, dtype=dtype)])


def test_flat_bytes_must_be_a_byte_view() -> None:
    with pytest.raises(CacheLayoutError, match="uint8 or int8"):
        KVCacheSpec.flat_bytes([torch.ones(4, 16, dtype=torch.float16)])


def test_layers_must_agree() -> None:
    a = torch.ones(layer_shape(KVLayout.MLA, 4, 2, 1, 8), dtype=torch.float16)
    b = torch.ones(layer_shape(KVLayout.MLA, 5, 2, 1, 8), dtype=torch.float16)
    with pytest.raises(CacheLayoutError, match="every layer must match layer 0"):
        KVCacheSpec.mla([a, b])
    with pytest.raises(CacheLayoutError, match="every layer must match layer 0"):
        KVCacheSpec.mla([a, a.clone().to(torch.bfloat16)])


def test_overlapping_layers_are_refused() -> None:
    buffer = torch.ones(6, 2, 4, dtype=torch.int8)
    with pytest.raises(CacheLayoutError, match="overlap"):
        KVCacheSpec.mla([buffer[:4], buffer[2:]])


def test_empty_and_foreign_inputs_are_refused() -> None:
    with pytest.raises(CacheLayoutError, match="at least one layer"):
        KVCacheSpec.mla([])
    with pytest.raises(CacheLayoutError, match=r"torch\.Tensor"):
        KVCacheSpec.mla([[1, 2, 3]])  # type: ignore[list-item]
    with pytest.raises(CacheLayoutError, match="unknown layout 'not_a_layout'"):
        KVCacheSpec.from_layout("not_a_layout", [torch.ones(4, 2, 3)])


def test_G6_repr_names_the_geometry_never_the_bytes() -> None:
    spec = KVCacheSpec.mla([torch.full((4, 2, 3), 123, dtype=torch.uint8)])
    text = repr(spec)
    assert "123" not in text
    assert text == (
        "KVCacheSpec(mla, 1 layers of (4, 2, 3) torch.uint8 on cpu, 4 blocks of 6 bytes)"
    )
