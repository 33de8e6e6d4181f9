"""Triton kernels: clear, and check, the planned blocks of every segment in one launch each.

Imported only by `kvguard.zeroize.triton_exec`, and only when Triton is installed: this module imports
Triton at the top. Under `TRITON_INTERPRET=1` (set before this module is imported) the same kernels run
on CPU tensors, which is how CI tests them.

Arguments are raw addresses, not tensors. `segments` is the address of an int64 table of segment base
addresses (uploaded once per cache), `blocks` the address of `num_plan_blocks` int64 block ids, `flags`
the address of `num_plan_blocks` int32 result flags (device memory, or pinned host memory that the GPU
writes directly, so reading the verdict back needs no copy). Plain integers keep the launch path short
(no tensor to inspect per argument) and make every call of one cache hit the same compiled kernel:
integers named in `do_not_specialize` are never specialized on their value (a count of 1, or one
divisible by 16, would otherwise compile a new variant), and integers carry no pointer-alignment
specialization.

Work decomposition. A *tile* is `TILE` consecutive words of one block's chunk in one segment; work item
`w` in `[0, num_segments * num_plan_blocks * TILES_PER_CHUNK)` is

    tile = w % TILES_PER_CHUNK, block = (w // TILES_PER_CHUNK) % num_plan_blocks,
    segment = w // (TILES_PER_CHUNK * num_plan_blocks)

so consecutive programs write consecutive bytes whenever planned blocks are adjacent. The grid is
persistent (a few programs per SM, each striding over work items), so one launch covers any plan.
The stride loop is a `while` loop on purpose: Triton 3.6's interpreter turns a `range` over runtime
bounds into `int()` of a one-element numpy array, which numpy 2.5 refuses ("only 0-dimensional arrays
can be converted to Python scalars"); a `while` condition only needs `bool()`, which every numpy allows.

Vector width. Addresses loaded from a table carry no alignment facts, so the compiler would emit scalar
accesses; `tl.multiple_of(..., ALIGN)` restores them. The launcher sets ALIGN to the largest power of
two (at most 16 bytes) dividing every segment address and the chunk size, so the hint is always true;
16 gives 128-bit `st.global.v4.b32` / `ld.global.v4.b32` accesses.
"""

# Triton's conventions, kept on purpose: upper-case `tl.constexpr` parameters, long positional
# parameter lists (kernels take no keyword-only arguments) and unannotated kernel arguments (Triton
# reads annotations as specialization hints, so Python types cannot go there).
# ruff: noqa: N803, PLR0917
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl

# Integer arguments compiled as plain i32/i64 values whatever they hold (module docstring).
_RUNTIME_INTS = ["segments", "blocks", "flags", "num_segments", "num_plan_blocks", "num_work"]


@triton.jit
def _word_pointer(address, WORD_BYTES: tl.constexpr):
    # Reinterpret an int64 byte address as a pointer to the widest word the alignment allows.
    if WORD_BYTES == 4:
        return address.to(tl.pointer_type(tl.int32))
    elif WORD_BYTES == 2:
        return address.to(tl.pointer_type(tl.int16))
    else:
        return address.to(tl.pointer_type(tl.int8))


@triton.jit
def _int64_pointer(address):
    # An address below 2**31 arrives as an i32 (Triton types integers by value; the interpreter sees
    # heap addresses that low under a non-PIE Python): widen before the cast, a no-op for an i64.
    return address.to(tl.int64).to(tl.pointer_type(tl.int64))


@triton.jit
def _tile_pointer(
    segments,  # address of [num_segments] int64 segment base addresses
    blocks,  # address of [num_plan_blocks] int64 block ids
    work,
    num_plan_blocks,
    CHUNK_WORDS: tl.constexpr,
    TILE: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    ALIGN: tl.constexpr,
):
    tile = work % TILES_PER_CHUNK
    rest = work // TILES_PER_CHUNK
    plan_index = rest % num_plan_blocks
    segment = rest // num_plan_blocks
    base = _word_pointer(tl.load(_int64_pointer(segments) + segment), WORD_BYTES)
    block = tl.load(_int64_pointer(blocks) + plan_index)  # int64: block * CHUNK_WORDS never wraps
    start = block * CHUNK_WORDS + tile * TILE
    pointer = tl.multiple_of(base + start, ALIGN)
    return pointer, tile * TILE, plan_index


@triton.jit(do_not_specialize=_RUNTIME_INTS[:2] + _RUNTIME_INTS[3:])
def zero_blocks_kernel(
    segments,  # address of [num_segments] int64
    blocks,  # address of [num_plan_blocks] int64
    num_segments,
    num_plan_blocks,
    num_work,  # num_segments * num_plan_blocks * TILES_PER_CHUNK
    CHUNK_WORDS: tl.constexpr,  # words of one block in one segment
    TILE: tl.constexpr,  # words per work item (a power of two)
    TILES_PER_CHUNK: tl.constexpr,
    WORD_BYTES: tl.constexpr,  # 4, 2 or 1
    ALIGN: tl.constexpr,  # bytes every tile start is a multiple of
    EVEN: tl.constexpr,  # TILE divides CHUNK_WORDS: no mask needed
):
    offsets = tl.arange(0, TILE)
    work = tl.program_id(0)
    while work < num_work:
        pointer, tile_start, _ = _tile_pointer(
            segments, blocks, work, num_plan_blocks,
            CHUNK_WORDS, TILE, TILES_PER_CHUNK, WORD_BYTES, ALIGN,
        )  # fmt: skip
        zeros = tl.full([TILE], 0, pointer.dtype.element_ty)
        if EVEN:
            tl.store(pointer + offsets, zeros)
        else:
            tl.store(pointer + offsets, zeros, mask=tile_start + offsets < CHUNK_WORDS)
        work += tl.num_programs(0)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def dirty_blocks_kernel(
    segments,  # address of [num_segments] int64
    blocks,  # address of [num_plan_blocks] int64
    flags,  # address of [num_plan_blocks] int32, zero on entry; set to 1 where any word is non-zero
    num_segments,
    num_plan_blocks,
    num_work,
    CHUNK_WORDS: tl.constexpr,
    TILE: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr,
    WORD_BYTES: tl.constexpr,
    ALIGN: tl.constexpr,
    EVEN: tl.constexpr,
):
    offsets = tl.arange(0, TILE)
    flag_words = flags.to(tl.int64).to(tl.pointer_type(tl.int32))
    work = tl.program_id(0)
    while work < num_work:
        pointer, tile_start, plan_index = _tile_pointer(
            segments, blocks, work, num_plan_blocks,
            CHUNK_WORDS, TILE, TILES_PER_CHUNK, WORD_BYTES, ALIGN,
        )  # fmt: skip
        if EVEN:
            words = tl.load(pointer + offsets)
        else:
            words = tl.load(pointer + offsets, mask=tile_start + offsets < CHUNK_WORDS, other=0)
        found = tl.max((words != 0).to(tl.int32), axis=0)
        # Every writer stores the same 1, so concurrent tiles of one block need no atomics.
        tl.store(flag_words + plan_index, found, mask=found != 0)
        work += tl.num_programs(0)
