"""Descriptions of paged KV caches: which bytes belong to which block.

A cache is a list of per-layer tensors of one shape, dtype and device. Every supported layout stores a
block's bytes as one or two contiguous *chunks* per layer:

- one chunk (`vllm_cpu`, `block_major`, `mla`, `flat_bytes`): the block dimension is the outermost, so
  block `b` of a layer is bytes `[b * chunk_bytes, (b + 1) * chunk_bytes)` of that layer's tensor;
- two chunks (`vllm_flash`): the K and V halves lead (`[2, num_blocks, ...]`), so block `b` is one chunk
  in the K half and one in the V half, `num_blocks * chunk_bytes` apart.

A *segment* is one (layer, half) pair: a contiguous `[num_blocks, chunk_bytes]` byte array. Executors
only ever see segments, which is what lets one kernel launch cover every layout and dtype: the Triton
kernel gets a table of segment base addresses, the torch path a list of byte views.

The spec never copies or owns the tensors; the engine does. A spec is valid only while the engine keeps
those tensors alive and in place.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvguard.errors import CacheLayoutError

# Dtypes a KV cache is stored in. Executors work on the raw bytes, so any 1/2/4-byte dtype would do;
# the list is closed so that a surprise (a complex or sparse tensor, a quantized wrapper) is refused.
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    }
)


class KVLayout(enum.StrEnum):
    """How one layer's tensor is laid out. The value is the name used in evidence and docs."""

    VLLM_FLASH = "vllm_flash"  # [2, num_blocks, block_size, kv_heads, head_size] (vLLM CUDA)
    VLLM_CPU = "vllm_cpu"  # [num_blocks, kv_heads, block_size, 2 * head_size] (vLLM CPU backend)
    BLOCK_MAJOR = "block_major"  # [num_blocks, 2, block_size, kv_heads, head_size]
    MLA = "mla"  # [num_blocks, block_size, head_size] (one latent vector per token)
    FLAT_BYTES = "flat_bytes"  # [num_blocks, bytes_per_block] (HF transformers' paged cache)


# layout -> (dimensions, index of the block dimension, chunks per block)
_GEOMETRY: dict[KVLayout, tuple[int, int, int]] = {
    KVLayout.VLLM_FLASH: (5, 1, 2),
    KVLayout.VLLM_CPU: (4, 0, 1),
    KVLayout.BLOCK_MAJOR: (5, 0, 1),
    KVLayout.MLA: (3, 0, 1),
    KVLayout.FLAT_BYTES: (2, 0, 1),
}

_SHAPE_TEXT: dict[KVLayout, str] = {
    KVLayout.VLLM_FLASH: "[2, num_blocks, block_size, kv_heads, head_size]",
    KVLayout.VLLM_CPU: "[num_blocks, kv_heads, block_size, 2 * head_size]",
    KVLayout.BLOCK_MAJOR: "[num_blocks, 2, block_size, kv_heads, head_size]",
    KVLayout.MLA: "[num_blocks, block_size, head_size]",
    KVLayout.FLAT_BYTES: "[num_blocks, bytes_per_block]",
}

LayerTensors = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


@dataclass(frozen=True, eq=False)
class KVCacheSpec:
    """A validated description of a paged KV cache. Build it with one of the layout constructors."""

    # Never in the repr: a tensor's repr prints its values, and a spec may reach a log or an error (G6).
    layers: tuple[torch.Tensor, ...] = field(repr=False)
    layout: KVLayout
    num_blocks: int
    chunks_per_block: int  # 2 for the flash layout's K and V halves, else 1
    chunk_bytes: int  # bytes of one block in one segment

    # --- constructors, one per layout -------------------------------------------------------------

    @classmethod
    def vllm_flash(cls, layers: LayerTensors) -> KVCacheSpec:
        """vLLM CUDA attention backends: `[2, num_blocks, block_size, kv_heads, head_size]` per layer."""
        return cls.from_layout(KVLayout.VLLM_FLASH, layers)

    @classmethod
    def vllm_cpu(cls, layers: LayerTensors) -> KVCacheSpec:
        """vLLM CPU backend: `[num_blocks, kv_heads, block_size, 2 * head_size]` per layer."""
        return cls.from_layout(KVLayout.VLLM_CPU, layers)

    @classmethod
    def block_major(cls, layers: LayerTensors) -> KVCacheSpec:
        """Block-major caches: `[num_blocks, 2, block_size, kv_heads, head_size]` per layer."""
        return cls.from_layout(KVLayout.BLOCK_MAJOR, layers)

    @classmethod
    def mla(cls, layers: LayerTensors) -> KVCacheSpec:
        """Multi-head latent attention: `[num_blocks, block_size, head_size]` per layer."""
        return cls.from_layout(KVLayout.MLA, layers)

    @classmethod
    def flat_bytes(cls, layers: LayerTensors) -> KVCacheSpec:
        """A flat view, one row per block: `[num_blocks, bytes_per_block]` per layer."""
        return cls.from_layout(KVLayout.FLAT_BYTES, layers)

    @classmethod
    def vllm_views(cls, layers: LayerTensors) -> KVCacheSpec:
        """vLLM 0.32's per-layer views on any device: logical `[num_blocks, kv_heads, block_size,
        C]`, their strides permuted by the cache layout the attention backend chose
        (`vllm.v1.kv_cache_layout.KVCacheLayout`). Contiguous views (the CPU backend's LBHNC) are
        `vllm_cpu`. Otherwise, where each layer's blocks are dense pages one after another (the
        layer-outermost layouts, LBNHC the CUDA default among them), each layer is described by a
        `[num_blocks, page_bytes]` byte view of the same memory (`flat_bytes`). Layouts that put
        other layers' pages between a layer's blocks (B-outermost) are refused: a block's bytes
        would not be one chunk."""
        tensors = _unique_layers(layers)
        if all(t.is_contiguous() for t in tensors):
            return cls.vllm_cpu(tensors)
        return cls.flat_bytes([_dense_block_rows(index, t) for index, t in enumerate(tensors)])

    @classmethod
    def from_layout(cls, layout: KVLayout | str, layers: LayerTensors) -> KVCacheSpec:
        """Validate `layers` against `layout`; raises CacheLayoutError saying what was expected."""
        try:
            kind = KVLayout(layout)
        except ValueError:
            names = ", ".join(k.value for k in KVLayout)
            raise CacheLayoutError(f"unknown layout {layout!r}; expected one of {names}") from None
        tensors = _unique_layers(layers)
        ndim, block_dim, chunks = _GEOMETRY[kind]
        first = tensors[0]
        for index, tensor in enumerate(tensors):
            _check_tensor(kind, index, tensor, first, ndim)
        _check_layout_dims(kind, first)
        _check_no_overlap(tensors)
        num_blocks = first.shape[block_dim]
        if num_blocks == 0:
            raise CacheLayoutError(f"{kind}: the cache has no blocks (shape {tuple(first.shape)})")
        total = first.numel() * first.element_size()
        chunk_bytes = total // (chunks * num_blocks)
        return cls(tuple(tensors), kind, num_blocks, chunks, chunk_bytes)

    # --- derived facts ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        shape = tuple(self.layers[0].shape)
        return (
            f"KVCacheSpec({self.layout}, {self.num_layers} layers of {shape} {self.dtype} on "
            f"{self.device}, {self.num_blocks} blocks of {self.bytes_per_block} bytes)"
        )

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_segments(self) -> int:
        return len(self.layers) * self.chunks_per_block

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies over all layers (what clearing one block writes)."""
        return self.num_segments * self.chunk_bytes

    @functools.cached_property
    def segment_addresses(self) -> tuple[int, ...]:
        """Byte address of each segment, layer-major: (layer 0, K), (layer 0, V), (layer 1, K), ...

        Cached: the spec describes tensors that stay in place (module docstring), and 160 `data_ptr()`
        calls per release would be most of a one-block zeroization's host time.
        """
        half = self.num_blocks * self.chunk_bytes
        return tuple(
            tensor.data_ptr() + part * half
            for tensor in self.layers
            for part in range(self.chunks_per_block)
        )

    def segment_views(self) -> list[torch.Tensor]:
        """Each segment as a `[num_blocks, chunk_bytes]` uint8 view (no copy), same order as above."""
        views: list[torch.Tensor] = []
        for tensor in self.layers:
            flat = tensor.reshape(-1).view(torch.uint8)
            views.extend(
                flat.view(self.chunks_per_block, self.num_blocks, self.chunk_bytes).unbind(0)
            )
        return views


def _dense_block_rows(index: int, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (block dimension first) as a `[num_blocks, page_bytes]` uint8 view of the same
    memory, if each block is one dense page and the pages follow each other; CacheLayoutError
    otherwise (never a guess: a wrong view would clear another layer's bytes)."""
    if tensor.dim() < 2 or tensor.dtype not in SUPPORTED_DTYPES:
        raise CacheLayoutError(
            f"layer {index}: a strided KV cache view of shape {tuple(tensor.shape)} and dtype "
            f"{tensor.dtype} is not one kvguard can clear"
        )
    page = 1
    for stride, size in sorted(zip(tensor.stride()[1:], tensor.shape[1:], strict=True)):
        if size == 1:
            continue
        if stride != page:
            raise CacheLayoutError(
                f"layer {index}: a block of the KV cache view (shape {tuple(tensor.shape)}, "
                f"strides {tensor.stride()}) is not one dense page of memory"
            )
        page *= size
    if tensor.shape[0] > 1 and tensor.stride(0) != page:
        raise CacheLayoutError(
            f"layer {index}: the KV cache's blocks are {tensor.stride(0)} elements apart, pages of "
            f"{page}: other layers' bytes lie between them (use a layer-outermost "
            "VLLM_KV_CACHE_LAYOUT, e.g. LBNHC)"
        )
    item = tensor.element_size()
    rows = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return rows.set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * item,
        (tensor.shape[0], page * item),
        (page * item, 1),
    )


def _unique_layers(layers: LayerTensors) -> list[torch.Tensor]:
    """The layer tensors in order, with exact repeats dropped.

    vLLM maps several layer names to one tensor when layers share a KV cache; clearing it twice would
    be harmless but would double-count the bytes in the evidence.
    """
    tensors = list(layers.values()) if isinstance(layers, Mapping) else list(layers)
    if not tensors:
        raise CacheLayoutError("a KV cache needs at least one layer tensor, got none")
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    unique: list[torch.Tensor] = []
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise CacheLayoutError(
                f"layer tensors must be torch.Tensor, got {type(tensor).__name__}"
            )
        # The same memory described the same way: start, shape, strides and dtype (by start and
        # shape alone, a view with other strides was dropped unchecked; found by a review).
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            unique.append(tensor)
    return unique


def _check_tensor(
    kind: KVLayout, index: int, tensor: torch.Tensor, first: torch.Tensor, ndim: int
) -> None:
    where = f"{kind} layer {index}"
    if tensor.dim() != ndim:
        raise CacheLayoutError(
            f"{where}: expected {ndim} dimensions {_SHAPE_TEXT[kind]}, got shape {tuple(tensor.shape)}"
        )
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise CacheLayoutError(
            f"{where}: dtype {tensor.dtype} is not supported; expected one of {names}"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise CacheLayoutError(f"{where}: expected a dense strided tensor, got {tensor.layout}")
    if not tensor.is_contiguous():
        raise CacheLayoutError(
            f"{where}: expected a contiguous tensor {_SHAPE_TEXT[kind]}, got strides "
            f"{tensor.stride()} for shape {tuple(tensor.shape)}; describe the underlying contiguous "
            "buffer instead of a permuted view"
        )
    if (tensor.shape, tensor.dtype, tensor.device) != (first.shape, first.dtype, first.device):
        raise CacheLayoutError(
            f"{where}: every layer must match layer 0 ({tuple(first.shape)}, {first.dtype}, "
            f"{first.device}), got ({tuple(tensor.shape)}, {tensor.dtype}, {tensor.device})"
        )


def _check_layout_dims(kind: KVLayout, tensor: torch.Tensor) -> None:
    shape = tuple(tensor.shape)
    if kind is KVLayout.VLLM_FLASH and shape[0] != 2:
        raise CacheLayoutError(
            f"{kind}: dimension 0 must be 2 (K and V) in {_SHAPE_TEXT[kind]}, got {shape}"
        )
    if kind is KVLayout.BLOCK_MAJOR and shape[1] != 2:
        raise CacheLayoutError(
            f"{kind}: dimension 1 must be 2 (K and V) in {_SHAPE_TEXT[kind]}, got {shape}"
        )
    if kind is KVLayout.VLLM_CPU and shape[3] % 2 != 0:
        raise CacheLayoutError(
            f"{kind}: the last dimension must be 2 * head_size (even), got {shape}"
        )
    if kind is KVLayout.FLAT_BYTES and tensor.dtype not in (torch.uint8, torch.int8):
        raise CacheLayoutError(
            f"{kind}: a flat byte view must be uint8 or int8, got {tensor.dtype}"
        )
    if tensor.numel() == 0 and shape[1 if kind is KVLayout.VLLM_FLASH else 0] != 0:
        raise CacheLayoutError(f"{kind}: blocks of zero bytes, shape {shape}")


def _check_no_overlap(tensors: list[torch.Tensor]) -> None:
    """Distinct layers must not share bytes: clearing one layer's block would clear another's."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise CacheLayoutError(
                "two layer tensors overlap in memory but are not the same tensor"
            )
