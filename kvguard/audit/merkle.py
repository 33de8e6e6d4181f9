"""RFC 6962 Merkle tree hashing and RFC 9162 proofs, as pure functions.

Pure math: no database, no I/O. Proof *generation* is split in two steps so that a store can serve
proofs with O(log n) reads (like Go's sumdb `StoredHashIndex` layout):

1. `inclusion_ranges` / `consistency_ranges` list the subtrees (half-open leaf ranges) whose hashes
   form the proof, following the recursive definitions of RFC 9162 sections 2.1.3.1 and 2.1.4.1;
2. `range_subtrees` decomposes each range into *complete* aligned subtrees (`Subtree(level, index)`),
   which is exactly what the store keeps; `fold_range` hashes them back together.

Verification follows RFC 9162 sections 2.1.3.2 and 2.1.4.2 step by step and raises
`VerificationError` (one family, fail closed) instead of returning a boolean.

This module depends on the standard library only: the offline verifier imports it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvguard.errors import VerificationError

# RFC 6962 section 2.1: domain separation between leaves and interior nodes, so that a leaf can never
# be passed off as an interior node (second-preimage attack on the tree).
_LEAF_PREFIX = b"\x00"
_NODE_PREFIX = b"\x01"

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()  # RFC 6962 section 2.1: MTH({}) = SHA-256()


class Subtree(NamedTuple):
    """A complete subtree of 2**level leaves starting at leaf `position * 2**level`."""

    level: int
    position: int


def leaf_hash(leaf: bytes) -> bytes:
    """MTH({d}) = SHA-256(0x00 || d) (RFC 6962 section 2.1)."""
    return hashlib.sha256(_LEAF_PREFIX + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """SHA-256(0x01 || left || right) (RFC 6962 section 2.1)."""
    return hashlib.sha256(_NODE_PREFIX + left + right).digest()


def _largest_power_of_two_below(n: int) -> int:
    """k such that k < n <= 2k (RFC 6962 section 2.1, `n > 1`)."""
    return 1 << ((n - 1).bit_length() - 1)


def range_subtrees(lo: int, hi: int) -> list[Subtree]:
    """Decompose leaves [lo, hi) into complete aligned subtrees, largest (leftmost) first.

    The ranges used by RFC 9162 proofs always start on a boundary aligned to a power of two at least
    as large as the range, so the decomposition is the binary expansion of `hi - lo`.
    """
    if not 0 <= lo < hi:
        raise ValueError(f"empty or negative range [{lo}, {hi})")
    out: list[Subtree] = []
    while lo < hi:
        size = 1 << ((hi - lo).bit_length() - 1)
        while lo % size:  # keep the subtree aligned if `lo` is not aligned to `size`
            size >>= 1
        level = size.bit_length() - 1
        out.append(Subtree(level, lo >> level))
        lo += size
    return out


def fold_range(hashes: Sequence[bytes]) -> bytes:
    """Hash the complete subtrees of one range (from `range_subtrees`) into MTH of that range.

    RFC 6962 splits at the largest power of two, so the right-hand part nests: fold from the right.
    """
    if not hashes:
        raise ValueError("no subtree hashes to fold")
    acc = hashes[-1]
    for h in reversed(hashes[:-1]):
        acc = node_hash(h, acc)
    return acc


def inclusion_ranges(index: int, size: int) -> list[tuple[int, int]]:
    """Leaf ranges of the audit path PATH(index, D[size]) (RFC 9162 section 2.1.3.1), leaf first."""
    if not 0 <= index < size:
        raise ValueError(f"leaf index {index} is not in a tree of size {size}")
    out: list[tuple[int, int]] = []
    lo, hi = 0, size
    while hi - lo > 1:
        k = _largest_power_of_two_below(hi - lo)
        if index - lo < k:
            out.append((lo + k, hi))
            hi = lo + k
        else:
            out.append((lo, lo + k))
            lo += k
    out.reverse()  # the recursion appends on the way out: deepest sibling first
    return out


def inclusion_path_length(index: int, size: int) -> int:
    """len(PATH(index, D[size])) without building it: the levels where `index` and `size - 1`
    differ (an inner path through complete subtrees) plus, above them, one hash per level where
    `index` is a right child on the right border (transparency-dev/merkle `decompInclProof`)."""
    if not 0 <= index < size:
        raise ValueError(f"leaf index {index} is not in a tree of size {size}")
    inner = (index ^ (size - 1)).bit_length()
    return inner + (index >> inner).bit_count()


def consistency_ranges(old_size: int, new_size: int) -> list[tuple[int, int]]:
    """Leaf ranges of PROOF(old_size, D[new_size]) (RFC 9162 section 2.1.4.1)."""
    if not 0 < old_size <= new_size:
        raise ValueError(f"no consistency proof from size {old_size} to size {new_size}")
    out: list[tuple[int, int]] = []
    lo, hi, m, whole = 0, new_size, old_size, True
    while m != hi - lo:
        k = _largest_power_of_two_below(hi - lo)
        if m <= k:
            out.append((lo + k, hi))
            hi = lo + k
        else:
            out.append((lo, lo + k))
            m -= k
            lo += k
            whole = False
    if not whole:  # SUBPROOF(m, D[m], false) = {MTH(D[m])}
        out.append((lo, hi))
    out.reverse()
    return out


HashReader = Callable[[Sequence[Subtree]], Sequence[bytes]]
"""Returns the stored hashes of the given complete subtrees, in order (raises if one is missing)."""


def hashes_for_ranges(ranges: Sequence[tuple[int, int]], read: HashReader) -> list[bytes]:
    """MTH of each range, using one batched `read` of O(log n) stored subtree hashes."""
    plans = [range_subtrees(lo, hi) for lo, hi in ranges]
    wanted = sorted({s for plan in plans for s in plan})
    found = dict(zip(wanted, read(wanted), strict=True))
    return [fold_range([found[s] for s in plan]) for plan in plans]


def root_from_subtrees(size: int, read: HashReader) -> bytes:
    """MTH(D[size]) from stored complete subtrees (the binary expansion of `size`)."""
    if size == 0:
        return EMPTY_ROOT
    return hashes_for_ranges([(0, size)], read)[0]


def _check_hash(value: bytes, what: str) -> None:
    if len(value) != HASH_SIZE:
        raise VerificationError(f"{what} is {len(value)} bytes, not {HASH_SIZE}")


def root_from_inclusion_proof(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """Root implied by an inclusion proof (RFC 9162 section 2.1.3.2, steps 1-5); raises if malformed."""
    if not 0 <= index < size:  # step 1
        raise VerificationError(f"leaf index {index} is not in a tree of size {size}")
    fn, sn, r = index, size - 1, leaf  # steps 2-3
    for p in proof:  # step 4
        _check_hash(p, "inclusion proof hash")
        if sn == 0:  # 4a
            raise VerificationError("inclusion proof is longer than the tree is deep")
        if fn & 1 or fn == sn:  # 4b
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1  # 4c
        sn >>= 1
    if sn != 0:  # step 5
        raise VerificationError("inclusion proof is shorter than the tree is deep")
    return r


def verify_inclusion(
    index: int, size: int, leaf_hash_: bytes, proof: Sequence[bytes], root: bytes
) -> None:
    """Raise VerificationError unless `proof` proves leaf `index` in the tree of `size` with `root`."""
    _check_hash(leaf_hash_, "leaf hash")
    computed = root_from_inclusion_proof(index, size, leaf_hash_, proof)
    if not hmac.compare_digest(computed, root):
        raise VerificationError(f"inclusion proof for leaf {index} does not lead to the root")


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> None:
    """Raise VerificationError unless `proof` shows tree `old_size` is a prefix of tree `new_size`.

    RFC 9162 section 2.1.4.2. Like transparency-dev/merkle, a proof from size 0 is refused (it proves
    nothing; the conformance README discusses the C2SP tlog-witness `old 0` exception).
    """
    if old_size <= 0 or old_size > new_size:
        raise VerificationError(f"no consistency proof from size {old_size} to size {new_size}")
    if old_size == new_size:
        if proof:
            raise VerificationError("sizes are equal but the consistency proof is not empty")
        if not hmac.compare_digest(old_root, new_root):
            raise VerificationError("sizes are equal but the roots differ")
        return
    if not proof:  # step 1
        raise VerificationError("consistency proof is empty")
    for p in proof:
        _check_hash(p, "consistency proof hash")
    fr, sr = _consistency_roots(old_size, new_size, old_root, proof)
    if not hmac.compare_digest(fr, old_root):  # step 7
        raise VerificationError("consistency proof does not lead to the old root")
    if not hmac.compare_digest(sr, new_root):
        raise VerificationError("consistency proof does not lead to the new root")


def _consistency_roots(
    old_size: int, new_size: int, old_root: bytes, proof: Sequence[bytes]
) -> tuple[bytes, bytes]:
    """RFC 9162 section 2.1.4.2 steps 2-7: the (old, new) roots a consistency proof implies."""
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # step 2: first is an exact power of two
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1  # step 3
    while fn & 1:  # step 4
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]  # step 5
    for c in path[1:]:  # step 6
        if sn == 0:  # 6a
            raise VerificationError("consistency proof is longer than the tree is deep")
        if fn & 1 or fn == sn:  # 6b
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1  # 6c
        sn >>= 1
    if sn != 0:  # step 7
        raise VerificationError("consistency proof is shorter than the tree is deep")
    return fr, sr


def tree_levels(leaf_hashes: Iterable[bytes]) -> list[list[bytes]]:
    """All levels of the RFC 6962 tree over `leaf_hashes`, bottom-up (for full in-memory checks).

    An odd last node is carried up unchanged, which builds exactly RFC 6962's largest-power-of-two
    split. Level `i` holds the hashes of the complete subtrees of 2**i leaves plus at most one
    incomplete right-edge subtree.
    """
    sha256 = hashlib.sha256
    levels = [list(leaf_hashes)]
    while len(levels[-1]) > 1:
        below = levels[-1]
        # node_hash inlined: one Python call less per node (the offline `--full` check's tree)
        up = [
            sha256(_NODE_PREFIX + below[i] + below[i + 1]).digest()
            for i in range(0, len(below) - 1, 2)
        ]
        if len(below) % 2:
            up.append(below[-1])
        levels.append(up)
    return levels


def levels_root(levels: Sequence[Sequence[bytes]]) -> bytes:
    """Root of a tree built by `tree_levels`."""
    return levels[-1][0] if levels[0] else EMPTY_ROOT


def levels_inclusion_proof(levels: Sequence[Sequence[bytes]], index: int) -> list[bytes]:
    """PATH(index, D[n]) read off the levels of `tree_levels`: the sibling at each level, if any."""
    proof: list[bytes] = []
    for level in levels[:-1]:
        sibling = index ^ 1
        if sibling < len(level):
            proof.append(level[sibling])
        index >>= 1
    return proof


LEVEL_SHIFT = 48  # 2**48 leaves per level is far beyond any ledger


def stored_hash_key(level: int, index: int) -> int:
    """One integer key per complete subtree: `level << 48 | index` (level 0 keys are leaf indices)."""
    return (level << LEVEL_SHIFT) | index


def split_stored_hash_key(key: int) -> Subtree:
    return Subtree(key >> LEVEL_SHIFT, key & ((1 << LEVEL_SHIFT) - 1))


class Frontier:
    """The right edge of a growing tree: the complete subtrees of the binary expansion of `size`.

    Appending a leaf completes one interior subtree per level it closes, which is exactly what the
    store must persist besides the leaf hash; O(log n) memory. The edge is kept as two plain stacks
    (levels, hashes): this runs once per appended entry, and building `Subtree` tuples cost about a
    third of it (profiled).
    """

    def __init__(self, size: int, nodes: Sequence[tuple[Subtree, bytes]]) -> None:
        expected = range_subtrees(0, size) if size else []
        if [s for s, _ in nodes] != expected:
            raise ValueError("frontier nodes do not match the tree size")
        self.size = size
        self._levels = [s.level for s, _ in nodes]  # strictly decreasing, like the binary expansion
        self._hashes = [h for _, h in nodes]

    def copy(self) -> Frontier:
        out = Frontier(0, [])
        out.size, out._levels, out._hashes = self.size, list(self._levels), list(self._hashes)
        return out

    def append(self, leaf_hash_: bytes) -> list[tuple[int, bytes]]:
        """Add one leaf hash; return the interior subtrees it completes (lowest first) as
        (`stored_hash_key(level, index)`, hash) pairs. Its own level-0 hash is `leaf_hash_`."""
        levels, hashes = self._levels, self._hashes
        level, index, h = 0, self.size, leaf_hash_
        done: list[tuple[int, bytes]] = []
        while levels and levels[-1] == level:
            levels.pop()
            level, index = level + 1, index >> 1
            h = hashlib.sha256(_NODE_PREFIX + hashes.pop() + h).digest()
            done.append(((level << LEVEL_SHIFT) | index, h))
        levels.append(level)
        hashes.append(h)
        self.size += 1
        return done

    def root(self) -> bytes:
        return fold_range(self._hashes) if self._hashes else EMPTY_ROOT


def levels_prefix_root(levels: Sequence[Sequence[bytes]], size: int) -> bytes:
    """MTH of the first `size` leaves of a tree built by `tree_levels` (for checkpoint checks)."""
    if size == 0:
        return EMPTY_ROOT
    return fold_range([levels[s.level][s.position] for s in range_subtrees(0, size)])
