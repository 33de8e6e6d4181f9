"""`kvguard verify --full`: the byte-exact check of a complete `entries.jsonl` against the signed root.

Two streaming passes over the file, no JSON parsing (standard library only, like `offline`):

1. `full_levels`: the leaf of every line (at its `event` position, its length read off the base64
   after the last `"leaf":"`), its RFC 6962 leaf hash and its length; the tree is rebuilt from all
   leaf hashes and its root must be the signed one. Nothing about a line is trusted yet: a line
   whose layout is wrong only yields a wrong leaf (and then a wrong root, or a failure in pass 2).
2. `check_lines`: line `i` must equal, byte for byte, the one canonical line for index `i`, the leaf
   sitting at its `event` position (length from pass 1) and the audit path read off the rebuilt tree,
   and the leaves must be the ones pass 1 hashed (a digest per block of lines, `_check_part`), so a
   file changed between the passes fails. A leaf a line carries as an event must be one
   (`bundle.first_non_event`, a pattern match per block of lines), as the plain verifier requires.

Why this checks every inclusion proof without hashing any of them: the proof in line `i` is compared
with PATH(i) read off the levels of the RFC 6962 tree of all the leaves (`merkle.levels_inclusion_
proof`, held equal to the RFC 9162 recursion by the conformance tests), and that tree's root is the
signed root. PATH(i) of a tree always verifies against its root (RFC 9162 section 2.1.3.2 is the
inverse of 2.1.3.1), so each line's proof verifies; and a line holding anything else differs from its
canonical form. Re-verifying each proof by hashing (~20 SHA-256 per entry) was 2x slower (43,000
entries/s) and proves nothing more. Any other layout (reordered keys, whitespace, a missing line)
also differs, and the file must end after line `size`.

Both passes split the file at a line boundary near its middle and check the first part in a forked
child process while this process checks the second (`_run_parts`): the work is independent per line, and
the benchmark machine has two cores. Failures come back as (line, reason) and the lowest line wins,
so the report names the first failing entry as a single process would. Where `fork` is missing, or
the file is small, one process checks everything.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import multiprocessing
import os
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count
from operator import methodcaller
from pathlib import Path
from typing import Any

from kvguard.audit import bundle, merkle
from kvguard.errors import VerificationError

Progress = Callable[[int, int], None]  # (bytes done, bytes) of the part checked in this process
Where = Callable[[int], str]  # names line `i` (0-based) of entries.jsonl in a failure
Levels = list[list[bytes]]

# The fixed parts of a canonical entry line (`bundle.entry_line`, keys sorted):
# {"event":<leaf>,"inclusion_proof":[<"b64",...>],"index":<i>,"leaf":"<b64 of leaf>"}\n
_EVENT = b'{"event":'
_PROOF = b',"inclusion_proof":['
_INDEX = b'],"index":%d,"leaf":"'
_END = b'"}\n'
_LEAF_KEY = b'"leaf":"'
# A foreign entry's line (`bundle.leaf_event` is None): `"event":null`, the leaf as base64 only.
_FOREIGN = _EVENT + bundle.FOREIGN_EVENT + _PROOF
_is_foreign = methodcaller("startswith", _FOREIGN)
_LEAF_PREFIX = b"\x00"  # RFC 6962 section 2.1 (as `merkle.leaf_hash`, inlined on the hot path)
_BLOCK = 256 << 10  # bytes per read + split: larger blocks fall out of the L2 cache (measured)
_PARALLEL_MIN_BYTES = 8 << 20  # below ~6,000 entries a fork costs more than it saves
# The longest line of any bundle file (a leaf's 4,096 block ids, a proof's 64 hashes, with room):
# past it a line is refused, not carried (and re-copied) in memory. The plain verifier's bound too.
MAX_LINE = 16 << 20
_OVERLONG = "a line longer than any line of its kind"


@dataclass(frozen=True)
class Part:
    """Bytes [start, stop) of the file; after pass 1 also its lines [first, end) and, per block of
    lines pass 1 read, its number of lines and the SHA-256 of its leaves concatenated."""

    start: int
    stop: int
    first: int = 0
    end: int = 0
    blocks: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class Tree:
    """What pass 1 learnt: the tree levels, each leaf's length, the numbered parts."""

    levels: Levels
    lengths: array[int]
    parts: list[Part]


class _PartError(Exception):
    """A failing line, counted from the start of its part (parts fail independently)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(line, reason)
        self.line, self.reason = line, reason


def split(path: Path, parallel: bool) -> list[Part]:
    """One part, or two split at the line boundary after the middle byte."""
    size = path.stat().st_size
    if not parallel or size < _PARALLEL_MIN_BYTES or not _can_fork():
        return [Part(0, size)]
    with open(path, "rb") as f:
        f.seek(size // 2)
        if not f.readline(MAX_LINE + 1).endswith(b"\n"):
            return [Part(0, size)]  # no line ends near the middle: one part, which fails
        middle = f.tell()
    return [Part(0, middle), Part(middle, size)]


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods() and (os.cpu_count() or 1) > 1


def full_levels(
    path: Path, parts: list[Part], where: Where, progress: Progress | None, max_lines: int
) -> Tree:
    """Pass 1: leaf hashes and lengths of every line, and the tree over them. A part holding more
    than `max_lines` lines (the signed size) fails as soon as it does: nothing is kept per line
    beyond what the signed size allows."""
    hashes: list[bytes] = []
    lengths: array[int] = array("Q")
    numbered: list[Part] = []
    outcomes = _run_parts(_leaf_hashes, path, parts, progress, (max_lines,))
    for part, outcome in zip(parts, outcomes, strict=True):
        if isinstance(outcome, _PartError):
            raise VerificationError(f"{where(len(hashes) + outcome.line)}: {outcome.reason}")
        part_hashes, part_lengths, blocks = outcome
        first, end = len(hashes), len(hashes) + len(part_hashes)
        numbered.append(Part(part.start, part.stop, first, end, tuple(blocks)))
        hashes.extend(part_hashes)
        lengths.extend(part_lengths)
    return Tree(merkle.tree_levels(hashes), lengths, numbered)


def check_lines(path: Path, tree: Tree, where: Where, progress: Progress | None) -> None:
    """Pass 2: every line is exactly its canonical form (see the module docstring)."""
    extra = (tree, path.stat().st_size)
    outcomes = _run_parts(_check_part, path, tree.parts, progress, extra)
    for part, outcome in zip(tree.parts, outcomes, strict=True):
        if isinstance(outcome, _PartError):
            raise VerificationError(f"{where(part.first + outcome.line)}: {outcome.reason}")


def _run_parts(
    work: Callable[..., Any],
    path: Path,
    parts: list[Part],
    progress: Progress | None,
    extra: tuple[Any, ...],
) -> list[Any]:
    """`work(path, part, progress, *extra)` for each part, the first in a forked child (arguments
    inherited, not pickled), the last here. Outcomes in part order; a `_PartError` is returned,
    not raised, so that the caller reports the lowest failing line."""
    if len(parts) == 1:
        return [_outcome(work, path, parts[0], progress, extra)]
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, work, path, parts[0], extra), daemon=True)
    child.start()
    send.close()
    try:
        mine = _outcome(work, path, parts[1], progress, extra)
        theirs = receive.recv()
    except EOFError:
        raise VerificationError("the verifying child process died") from None
    finally:
        receive.close()
        child.join()
    if isinstance(theirs, BaseException) and not isinstance(theirs, _PartError):
        raise theirs
    return [theirs, mine]


def _outcome(
    work: Callable[..., Any], path: Path, part: Part, progress: Progress | None, extra: Any
) -> Any:
    try:
        return work(path, part, progress, *extra)
    except _PartError as failure:
        return failure


def _child(send: Any, work: Callable[..., Any], path: Path, part: Part, extra: Any) -> None:
    try:
        result = _outcome(work, path, part, None, extra)
    except Exception as exc:
        result = exc
    send.send(result)
    send.close()


def _line_blocks(path: Path, part: Part) -> Iterator[list[bytes]]:
    """The lines of bytes [start, stop) of a file, each with its newline (but a last line without
    one), in blocks of about `_BLOCK` bytes. `BytesIO.readlines` finds newlines with `memchr`:
    0.19 us per 1.4 KB line, where `bytes.split` compares byte by byte (1.1 us) and
    `BufferedReader.readlines` is as slow (measured)."""
    carry, remaining, seen = b"", part.stop - part.start, 0
    with open(path, "rb") as f:
        f.seek(part.start)
        while remaining > 0:
            data = f.read(min(_BLOCK, remaining))
            if not data:  # the file shrank since it was split
                break
            remaining -= len(data)
            lines = io.BytesIO(carry + data).readlines()
            carry = lines.pop() if not lines[-1].endswith(b"\n") else b""
            if len(carry) > MAX_LINE:
                raise _PartError(seen + len(lines), _OVERLONG)
            if lines:
                seen += len(lines)
                yield lines
    if carry:
        yield [carry]


def _leaf_hashes(
    path: Path, part: Part, progress: Progress | None, max_lines: int
) -> tuple[list[bytes], array[int], list[tuple[int, bytes]]]:
    """Pass 1 over one part: its leaf hashes and leaf lengths, with list comprehensions over
    blocks of lines (about a third less interpreter work per line than one loop body, measured).

    The leaf is taken at its `event` position, its length read off the length of the base64 after
    the last `"leaf":"` (4 characters per 3 bytes, less one per `=`): slicing, where decoding
    cost 0.6 us more per line (measured). Nothing is trusted here: a malformed line only yields a
    wrong leaf, which fails the root or pass 2 (which compares the whole line, base64 included).

    Also returns, per block, its number of lines and the SHA-256 of its leaves concatenated: pass 2
    compares them with the same of the leaves it reads, which proves they are these leaves
    (`_check_part`).
    """
    sha256, key, at, around = hashlib.sha256, _LEAF_KEY, len(_EVENT), len(_LEAF_KEY) + len(_END)
    hashes: list[bytes] = []
    lengths: array[int] = array("Q")
    blocks: list[tuple[int, bytes]] = []
    done = 0
    for lines in _line_blocks(path, part):
        # base64 length: len(x) - rfind(key) - around; its padding `=` sit in x[-5:-3]
        leaves = [
            x[at : at + (len(x) - x.rfind(key) - around) // 4 * 3 - x[-5:-3].count(61)]
            for x in lines
        ]
        if any(map(_is_foreign, lines)):  # rare: a foreign leaf is read from its base64
            leaves = [
                _foreign_leaf(x) if _is_foreign(x) else y
                for x, y in zip(lines, leaves, strict=True)
            ]
        if len(hashes) + len(leaves) > max_lines:
            raise _PartError(max_lines, f"more lines than the checkpoint's {max_lines} entries")
        hashes += [sha256(_LEAF_PREFIX + leaf).digest() for leaf in leaves]
        lengths.extend(map(len, leaves))
        blocks.append((len(leaves), sha256(b"".join(leaves)).digest()))
        if progress is not None:
            done += sum(map(len, lines))
            progress(done, part.stop - part.start)
    return hashes, lengths, blocks


def _check_part(
    path: Path,
    part: Part,
    progress: Progress | None,
    tree: Tree,
    size: int,
) -> None:
    """Pass 2 over one part: lines [first, end) are exactly bytes [start, stop), each canonical;
    the last part must also end the file (the size pass 1 saw: a file that grew fails).

    Each line's leaf must be the leaf pass 1 hashed into the tree (else a file changed between the
    passes could pass). Re-hashing every leaf cost 0.6-1 us per entry; instead each block must hold
    as many lines as pass 1's block of the same number, and its leaves, sliced at pass 1's lengths,
    must have the SHA-256 pass 1 took of that block's leaves. A slice is never longer than pass 1's
    length, so equal digests (hence, SHA-256 being collision resistant, equal concatenations of
    equal total length) mean every slice has exactly that length, and so every leaf is pass 1's
    leaf of the same index. A changed block fails at its first line.
    """
    sha256, b2a, join = hashlib.sha256, binascii.b2a_base64, b"".join
    paths, lengths, blocks = PathText(tree.levels), tree.lengths, part.blocks
    body, index, done = len(_EVENT), part.first, 0
    for block, lines in enumerate(_line_blocks(path, part)):
        stop = index + len(lines)
        if block >= len(blocks) or blocks[block][0] != len(lines):
            raise _PartError(index - part.first, "the file changed while verifying")
        leaves = [line[body : body + n] for line, n in zip(lines, lengths[index:stop], strict=True)]
        proofs = paths.block(index, stop)
        expected = [
            join((_EVENT, leaf, _PROOF, proof, _INDEX % i, b2a(leaf, newline=False), _END))
            for i, leaf, proof in zip(count(index), leaves, proofs)
        ]
        foreign = any(map(_is_foreign, lines))
        if foreign:
            _foreign_lines(lines, leaves, expected, proofs, lengths[index:stop], index, part.first)
        if lines != expected:
            _raise_first(lines, expected, index - part.first)
        _check_events(lines, leaves, index - part.first, foreign=foreign)
        if sha256(join(leaves)).digest() != blocks[block][1]:
            raise _PartError(index - part.first, "the file changed while verifying")
        index = stop
        if progress is not None:
            done += sum(map(len, lines))
            progress(done, part.stop - part.start)
    if index != part.end:
        raise _PartError(index - part.first, "the file changed while verifying")
    if part.stop == size and path.stat().st_size != size:
        raise _PartError(index - part.first, "the file changed while verifying")


def _foreign_leaf(line: bytes) -> bytes:
    """The leaf of a foreign entry's line, from its base64 (b"" when it does not decode: a wrong
    leaf, which fails the root or pass 2)."""
    start = line.rfind(_LEAF_KEY) + len(_LEAF_KEY)
    try:
        return binascii.a2b_base64(line[start : line.rfind(_END[:2])], strict_mode=True)
    except (binascii.Error, ValueError):
        return b""


def _foreign_lines(  # noqa: PLR0917 (private: pass 2's own state, in its order)
    lines: list[bytes],
    leaves: list[bytes],
    expected: list[bytes],
    proofs: list[bytes],
    lengths: array[int],
    index: int,
    first: int,
) -> None:
    """Pass 2 for the foreign lines of a block (`leaves`, `expected` updated in place): the leaf
    comes from the base64, no longer than pass 1's length (as `_check_part` requires), the
    expected line carries `"event":null`, and the leaf must not be a kvguard event (an exporter
    never carries an event as foreign)."""
    for j, line in enumerate(lines):
        if not _is_foreign(line):
            continue
        leaf = leaves[j] = _foreign_leaf(line)[: lengths[j]]
        expected[j] = b"".join(
            (
                _FOREIGN,
                proofs[j],
                _INDEX % (index + j),
                binascii.b2a_base64(leaf, newline=False),
                _END,
            )
        )
        if bundle.leaf_event(leaf) is not None:
            raise _PartError(index + j - first, "a kvguard event is carried as a foreign entry")


def _check_events(lines: list[bytes], leaves: list[bytes], offset: int, *, foreign: bool) -> None:
    """Every leaf a line carries as an event must be one (`bundle.is_event`): an exporter holding
    the signing key could otherwise embed a foreign leaf as an event (invalid JSON, or keys that
    shadow the line's own) in a file whose bytes and proofs are otherwise canonical."""
    if not foreign:
        bad = bundle.first_non_event(leaves)
        if bad is None:
            return
        raise _PartError(offset + bad, "a leaf that is not a kvguard event is carried as one")
    carried = [j for j, line in enumerate(lines) if not _is_foreign(line)]
    bad = bundle.first_non_event([leaves[j] for j in carried])
    if bad is not None:
        raise _PartError(
            offset + carried[bad], "a leaf that is not a kvguard event is carried as one"
        )


def _raise_first(lines: list[bytes], expected: list[bytes], offset: int) -> None:
    for number, (line, want) in enumerate(zip(lines, expected, strict=True)):
        if line != want:
            raise _PartError(offset + number, "line differs from the canonical entry")
    raise AssertionError("no line of the block differs")  # internal invariant


class PathText:
    """The rendered audit paths (`"b64","b64",...` as bytes) of consecutive leaves of one tree.

    PATH(i) is the sibling at each level below the root that exists (`merkle.levels_inclusion_
    proof`). The part from level `l` up depends only on `i >> l`, so it is cached per level as
    `,"b64"` pieces and rebuilt only where the index changed: about one base64 encoding and two
    concatenations per entry, instead of one encoding per proof hash. `block` renders a run of
    consecutive leaves at once: the part from level 1 up once per pair of leaves, the level-0
    siblings in one comprehension (1.7-2.9 us per entry with one method call per entry, measured).
    """

    def __init__(self, levels: Levels) -> None:
        self._levels = levels
        self._top = len(levels) - 1  # the root level has no sibling
        self._tail = [b""] * (self._top + 2)  # tail[l]: the path from level l up, comma-led
        self._pair: int | None = None  # the pair (index >> 1) that `_tail` was last built for

    def path(self, index: int) -> bytes:
        return self.block(index, index + 1)[0]

    def block(self, first: int, stop: int) -> list[bytes]:
        """PATH(i) rendered, for i in [first, stop) (consecutive calls should move forward)."""
        leaves, first_pair = self._levels[0], first >> 1
        uppers = self._uppers(first_pair, ((stop - 1) >> 1) + 1)
        low, high = first & ~1, min(len(leaves), stop + 1)
        quoted = [b'"' + binascii.b2a_base64(h, newline=False) + b'"' for h in leaves[low:high]]
        # every leaf but an odd last one has its sibling at level 0
        paired = min(stop, len(leaves) - (len(leaves) & 1))
        out = [quoted[(i ^ 1) - low] + uppers[(i >> 1) - first_pair] for i in range(first, paired)]
        if paired < stop:  # the odd last leaf: its path starts at level 1 (drop the lead comma)
            out.append(uppers[-1][1:])
        return out

    def _uppers(self, first_pair: int, stop_pair: int) -> list[bytes]:
        """The comma-led path from level 1 up of each pair of leaves in [first_pair, stop_pair)."""
        levels, tail, top = self._levels, self._tail, self._top
        previous, out = self._pair, []
        for pair in range(first_pair, stop_pair):
            index = pair << 1
            # the levels at and above bit_length(index ^ previous) keep their node, hence sibling
            changed = top if previous is None else min(top, (index ^ (previous << 1)).bit_length())
            for level in range(changed - 1, 0, -1):
                hashes, sibling = levels[level], (index >> level) ^ 1
                if sibling < len(hashes):
                    own = b',"' + binascii.b2a_base64(hashes[sibling], newline=False) + b'"'
                    tail[level] = own + tail[level + 1]
                else:
                    tail[level] = tail[level + 1]
            out.append(tail[1])
            previous = pair
        self._pair = previous
        return out
