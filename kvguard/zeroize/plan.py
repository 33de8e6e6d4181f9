"""Planning: which blocks to clear, as sorted, deduplicated, coalesced runs.

No device: the custody core decides *which* blocks leave their scope; this module only turns that
list into a canonical plan and refuses anything that is not a block of the cache (an id out of range
would otherwise clear, or fail to clear, someone else's bytes).

Two paths, held equal by tests/zeroize/test_plan_native.py. The C extension `_plan` (built by
`pip install -e .` when a compiler is present) sorts and coalesces lists of plain ints through a
bitmap; pure Python (`set`, `sorted`, `map`, `compress`: one C-level pass per step, no Python loop
per id) decides everything else: booleans, numpy integers, non-integers, ids beyond 64 bits, and
every id when the extension is missing. Sorting 10,000 ints alone costs CPython 0.65-1 ms, above the
"well under 1 ms" target of issue 4. The runs are only coalesced when an executor asks for them.
Measured figures are in docs/zeroize.md.
"""

from __future__ import annotations

import array
import functools
import hashlib
import itertools
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from kvguard.errors import BlockIdError

try:
    from kvguard.zeroize import _plan as _native  # typed by its stub, _plan.pyi
except ImportError:  # installed without a C compiler: the pure-Python path below, same results
    _native = None  # type: ignore[assignment]

# Domain separation for the block-id digest, so it can never equal a digest of other data.
_DIGEST_PREFIX = b"kvguard/zeroize/block-ids/v1\x00"


# `(start, length)`: `length` consecutive blocks from `start`. A plain tuple, not a NamedTuple, whose
# Python-level constructor costs about 1 us a run (10 ms for 10,000 scattered ids).
BlockRun = tuple[int, int]


@dataclass(frozen=True)
class ZeroizePlan:
    """The canonical set of blocks to clear in a cache of `num_blocks` blocks."""

    num_blocks: int
    block_ids: tuple[int, ...]  # sorted, unique, each in [0, num_blocks)

    @functools.cached_property
    def runs(self) -> tuple[BlockRun, ...]:
        """Maximal runs of consecutive ids, in order.

        Computed on first use: the GPU kernel works per block and never asks, and coalescing costs
        about as much as sorting (two C-level passes per id), so a plan for it is half the price.
        """
        return _coalesce(self.block_ids)

    @property
    def is_empty(self) -> bool:
        return not self.block_ids

    def __len__(self) -> int:
        return len(self.block_ids)

    def block_ids_digest(self) -> str:
        """SHA-256 (hex) of the sorted ids, each as 8 bytes big-endian, after a domain prefix.

        Lets an audit record name the exact block set without listing it; an auditor holding the ids
        recomputes it with `digest_block_ids`.
        """
        return digest_block_ids(self.block_ids)

    def subset(self, block_ids: Iterable[int]) -> ZeroizePlan:
        """A plan over some of this plan's blocks (used to verify a sample)."""
        sub = plan_zeroize(block_ids, self.num_blocks)
        if not set(sub.block_ids) <= set(self.block_ids):
            raise BlockIdError("a subset plan may only name blocks of the plan it comes from")
        return sub


def digest_block_ids(block_ids: Iterable[int]) -> str:
    """The digest `ZeroizePlan.block_ids_digest` uses, for ids given in any order or repetition."""
    words = array.array("q", sorted(set(block_ids)))
    if sys.byteorder == "little":
        words.byteswap()
    return hashlib.sha256(_DIGEST_PREFIX + words.tobytes()).hexdigest()


def plan_zeroize(block_ids: Iterable[int], num_blocks: int) -> ZeroizePlan:
    """Deduplicate, sort and coalesce `block_ids`; raise BlockIdError for any id not in range.

    Booleans are refused (an `True` id is a bug upstream, not block 1); other integer-like values
    (numpy integers) are accepted through `__index__`.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise BlockIdError(f"num_blocks must be a positive int, got {num_blocks!r}")
    return ZeroizePlan(num_blocks, _canonical_ids(block_ids, num_blocks))


def native_planner_available() -> bool:
    """True when the C extension is built; without it, planning 10,000 ids costs about 9x more."""
    return _native is not None


def _canonical_ids(block_ids: Iterable[int], num_blocks: int) -> tuple[int, ...]:
    if _native is None:
        return _canonical_ids_python(block_ids, num_blocks)
    if type(block_ids) is not list and type(block_ids) is not tuple:
        # Materialized once, so that the Python path can still read it when C declines.
        try:
            block_ids = list(block_ids)
        except TypeError as exc:  # not iterable, or the iterator raised it: as `set()` would
            raise BlockIdError(f"block ids must be integers: {exc}") from None
    try:
        ids = _native.unique_sorted(block_ids, num_blocks)
    except IndexError as exc:
        raise _out_of_range(exc.args[0], num_blocks) from None
    # None: an item that is not a plain int of 64 bits, which the Python path decides.
    return _canonical_ids_python(block_ids, num_blocks) if ids is None else ids


def _canonical_ids_python(block_ids: Iterable[int], num_blocks: int) -> tuple[int, ...]:
    ids = sorted(_unique_ints(block_ids))
    if not ids:
        return ()
    if ids[0] < 0 or ids[-1] >= num_blocks:
        raise _out_of_range(ids[0] if ids[0] < 0 else ids[-1], num_blocks)
    return tuple(ids)


# `torch.tensor(True).__index__()` is 1: a boolean tensor is refused like a bool (a review).
_BOOL_DTYPES: Final = frozenset({"torch.bool", "bool"})


def _out_of_range(block_id: int, num_blocks: int) -> BlockIdError:
    return BlockIdError(f"block id {block_id} is outside the cache's range [0, {num_blocks})")


def _unique_ints(block_ids: Iterable[int]) -> set[int]:
    try:
        unique = set(block_ids)
    except TypeError as exc:  # unhashable items
        raise BlockIdError(f"block ids must be integers: {exc}") from None
    kinds = set(map(type, unique))  # one C-level pass; plain ints are the common case
    if kinds <= {int}:
        return unique
    # `True == 1`, so a boolean already merged with an equal int is harmless; one left standing is
    # a bug upstream, not block 1.
    if bool in kinds:
        raise BlockIdError("block ids must be integers, not booleans")
    if any(str(getattr(x, "dtype", "")) in _BOOL_DTYPES for x in unique):
        raise BlockIdError("block ids must be integers, not booleans")  # a torch bool tensor
    try:
        return set(map(operator.index, unique))  # numpy integers and other __index__ types
    except TypeError as exc:
        raise BlockIdError(f"block ids must be integers: {exc}") from None


def _coalesce(ids: tuple[int, ...]) -> tuple[BlockRun, ...]:
    """Maximal runs of consecutive ids in a sorted, duplicate-free tuple."""
    if _native is not None and type(ids) is tuple:
        runs = _native.coalesce(ids)
        if runs is not None:
            return runs
    return _coalesce_python(ids)


def _coalesce_python(ids: tuple[int, ...]) -> tuple[BlockRun, ...]:
    count = len(ids)
    # A run breaks at position k when ids[k] - ids[k-1] != 1.
    steps = map(operator.sub, itertools.islice(ids, 1, None), ids)
    breaks = list(itertools.compress(range(1, count), map((1).__ne__, steps)))
    starts = [0, *breaks]
    ends = [*breaks, count]
    if not ids:
        return ()
    return tuple(zip(map(ids.__getitem__, starts), map(operator.sub, ends, starts), strict=True))
