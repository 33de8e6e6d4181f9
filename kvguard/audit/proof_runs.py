"""Inclusion proofs of many entries against one signed tree, chunk by chunk (the streamed export).

PATH(i, D[n]) (RFC 9162 section 2.1.3.1) for an entry i of an aligned chunk [lo, hi) of 2**12
leaves, or of the right edge [lo, n), is PATH(i - lo, D[lo:hi]) followed by the path of the chunk's
own node: in an RFC 6962 tree every aligned complete range of 2**k leaves, and the right edge from an
aligned start, is a node. The first part comes off a small tree of the chunk's leaf hashes; the
second, the same for every entry of the chunk, is the tail of PATH(lo, D[n]) above the chunk, read
from the stored subtree hashes in one O(log n) round trip. Rendered text is built per level as
`offline_full.PathText` does, so an entry costs about one base64 encoding instead of ~20.

Every chunk is checked before any of its proofs leaves: the full path of its first leaf must lead to
the signed root. That fixes the chunk's root and node path, from which every other proof of the
chunk is read off (the argument of `kvguard.audit.offline_full`). Leaves of exported entries are
hashed from their bytes, never taken from the stored hash column.

A chunk holding only a few exported entries (a filtered export) gets per-entry proofs from the
stored hashes instead, each verified: cheaper than reading the chunk's 4,096 leaf hashes.
"""

from __future__ import annotations

import binascii
import hashlib
from collections.abc import Sequence

import sqlalchemy as sa

from kvguard.audit import merkle
from kvguard.audit.offline_full import PathText
from kvguard.audit.store import LedgerStore
from kvguard.errors import VerificationError

CHUNK_BITS = 12
_IN_CHUNK = 500  # keys per IN (...) list
_SPARSE = 8  # fewer exported entries than this in a chunk: per-entry proofs from stored hashes

Row = tuple[int, bytes]  # (index, leaf bytes)

_LEAF_HASHES = sa.text(
    "SELECT idx, leaf_hash FROM ledger_entries WHERE idx >= :lo AND idx < :hi ORDER BY idx"
)


def quoted(h: bytes) -> bytes:
    return b'"' + binascii.b2a_base64(h, newline=False) + b'"'


class ProofRuns:
    """Rendered proofs (`"b64","b64",...`) for the entries of one tree, one chunk at a time."""

    def __init__(
        self, store: LedgerStore, conn: sa.Connection, size: int, root: bytes, *, complete: bool
    ) -> None:
        self._store, self._conn = store, conn
        self._size, self._root = size, root
        self._complete = complete  # every entry is exported: chunks hash their own leaves

    def chunk(self, rows: Sequence[Row]) -> list[bytes]:
        """Proof texts of `rows`: entries of one chunk, in increasing index order."""
        lo = rows[0][0] >> CHUNK_BITS << CHUNK_BITS
        hi = min(self._size, lo + (1 << CHUNK_BITS))
        if rows[-1][0] >= hi:
            raise ValueError("rows span more than one chunk or lie beyond the tree")
        if self._complete:
            return self._whole(rows, lo, hi)
        if len(rows) < _SPARSE:
            return [self._single(index, leaf) for index, leaf in rows]
        if hi - lo < 1 << CHUNK_BITS:  # the right edge: not a perfect tree, read every leaf hash
            return self._whole(rows, lo, hi)
        return self._partial(rows, lo)

    def _upper(self, lo: int, hi: int) -> list[bytes]:
        """The path of node [lo, hi) to the root: PATH(lo, D[n]) above the chunk's own levels."""
        inner = (hi - lo - 1).bit_length()  # len(PATH(0, D[lo:hi]))
        return self._store.hashes_for_ranges(
            merkle.inclusion_ranges(lo, self._size)[inner:], self._size
        )

    def _check(self, index: int, leaf_hash: bytes, inner: list[bytes], upper: list[bytes]) -> None:
        """The full path of one entry of the chunk leads to the signed root (fixes the chunk)."""
        try:
            merkle.verify_inclusion(index, self._size, leaf_hash, inner + upper, self._root)
        except VerificationError as exc:
            raise VerificationError(f"the chunk of entry {index}: {exc}") from None

    def _whole(self, rows: Sequence[Row], lo: int, hi: int) -> list[bytes]:
        """The chunk's whole tree, from every leaf hash (the exported leaves hashed here)."""
        hashes = self._leaf_hashes(rows, lo, hi)
        levels = merkle.tree_levels(hashes)
        upper = self._upper(lo, hi)
        self._check(lo, hashes[0], merkle.levels_inclusion_proof(levels, 0), upper)
        tail = b"".join(b"," + quoted(h) for h in upper)
        paths = PathText(levels)
        if self._complete:
            texts = paths.block(0, hi - lo)
        else:
            texts = [paths.path(index - lo) for index, _ in rows]
        return [text + tail if text else tail[1:] for text in texts]

    def _leaf_hashes(self, rows: Sequence[Row], lo: int, hi: int) -> list[bytes]:
        mine = {index: merkle.leaf_hash(leaf) for index, leaf in rows}
        if self._complete:
            if len(rows) != hi - lo or rows[0][0] != lo:
                raise VerificationError(f"entries {lo}..{hi - 1}: the log has a gap")
            return list(mine.values())
        stored = self._conn.execute(_LEAF_HASHES, {"lo": lo, "hi": hi}).all()
        if [int(i) for i, _ in stored] != list(range(lo, hi)):
            raise VerificationError(f"entries {lo}..{hi - 1}: the log has a gap")
        hashes = [bytes(h) for _, h in stored]
        for index, h in mine.items():
            if hashes[index - lo] != h:
                raise VerificationError(f"entry {index}: leaf does not match its stored hash")
        return hashes

    def _partial(self, rows: Sequence[Row], lo: int) -> list[bytes]:
        """A perfect chunk holding some exported entries: only the nodes on their paths are
        hashed, each from its children; the siblings off those paths are read as stored (one
        batched read). Every path is read off this one partial tree, whose root `_check` fixes."""
        leaves = {index - lo: merkle.leaf_hash(leaf) for index, leaf in rows}
        nodes = _PartialTree(leaves, lo, self._read)
        upper = self._upper(lo, lo + (1 << CHUNK_BITS))
        first = rows[0][0] - lo
        self._check(rows[0][0], leaves[first], nodes.siblings(first), upper)
        tail = b"".join(b"," + quoted(h) for h in upper)
        return [nodes.text(index - lo) + tail for index, _ in rows]

    def _read(self, subtrees: Sequence[merkle.Subtree]) -> list[bytes]:
        """Stored hashes of `subtrees` in one or a few statements on the driver's cursor (through
        SQLAlchemy's result rows the same reads cost twice as much, profiled)."""
        leaves = [s.position for s in subtrees if s.level == 0]
        nodes = [merkle.stored_hash_key(s.level, s.position) for s in subtrees if s.level > 0]
        found: dict[tuple[int, int], bytes] = {}
        cursor = self._conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        mark = "?" if self._conn.dialect.paramstyle == "qmark" else "%s"
        try:
            for kind, select, keys in (
                (0, "SELECT idx, leaf_hash FROM ledger_entries WHERE idx", leaves),
                (1, "SELECT id, hash FROM ledger_hashes WHERE id", nodes),
            ):
                for at in range(0, len(keys), _IN_CHUNK):
                    part = keys[at : at + _IN_CHUNK]
                    cursor.execute(f"{select} IN ({', '.join([mark] * len(part))})", part)
                    found.update(((kind, int(k)), bytes(h)) for k, h in cursor.fetchall())
        finally:
            cursor.close()
        try:
            return [
                found[(0, s.position)]
                if s.level == 0
                else found[(1, merkle.stored_hash_key(s.level, s.position))]
                for s in subtrees
            ]
        except KeyError:
            raise VerificationError("a stored subtree hash is missing") from None

    def _single(self, index: int, leaf: bytes) -> bytes:
        proof = self._store.hashes_for_ranges(
            merkle.inclusion_ranges(index, self._size), self._size
        )
        merkle.verify_inclusion(index, self._size, merkle.leaf_hash(leaf), proof, self._root)
        return b",".join(quoted(h) for h in proof)


class _PartialTree:
    """The nodes of a perfect chunk tree of 2**CHUNK_BITS leaves that exported paths touch: the
    ancestors of exported leaves, hashed here from their children, and their siblings, as stored.
    `nodes[l][j]` is node j of level l (relative to the chunk)."""

    def __init__(self, leaves: dict[int, bytes], lo: int, read: merkle.HashReader) -> None:
        active = [set(leaves)]
        for _ in range(CHUNK_BITS):
            active.append({j >> 1 for j in active[-1]})
        wanted = sorted(
            merkle.Subtree(level, (lo >> level) + (j ^ 1))
            for level in range(CHUNK_BITS)
            for j in active[level]
            if j ^ 1 not in active[level]
        )
        self.nodes: list[dict[int, bytes]] = [{} for _ in range(CHUNK_BITS + 1)]
        for s, h in zip(wanted, read(wanted), strict=True):
            self.nodes[s.level][s.position - (lo >> s.level)] = h
        self.nodes[0].update(leaves)
        sha256, prefix = hashlib.sha256, b"\x01"  # RFC 6962 node hash, as `merkle.node_hash`
        for level in range(CHUNK_BITS):
            below = self.nodes[level]
            self.nodes[level + 1].update(
                (p, sha256(prefix + below[2 * p] + below[2 * p + 1]).digest())
                for p in active[level + 1]
            )
        self._tails: list[dict[int, bytes]] = [{} for _ in range(CHUNK_BITS + 1)]

    def siblings(self, i: int) -> list[bytes]:
        return [self.nodes[level][(i >> level) ^ 1] for level in range(CHUNK_BITS)]

    def text(self, i: int) -> bytes:
        """PATH(i) within the chunk, rendered: the level-0 sibling, then the path from level 1 up,
        which depends only on i >> 1 and is rendered once per pair (as `PathText` does)."""
        return quoted(self.nodes[0][i ^ 1]) + self._tail(1, i >> 1)

    def _tail(self, level: int, j: int) -> bytes:
        """`,"sibling",...` of node j of `level` up to the chunk root (memoised per node)."""
        if level == CHUNK_BITS:
            return b""
        done = self._tails[level].get(j)
        if done is None:
            done = b"," + quoted(self.nodes[level][j ^ 1]) + self._tail(level + 1, j >> 1)
            self._tails[level][j] = done
        return done
