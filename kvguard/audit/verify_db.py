"""`Ledger.verify()`: recompute everything from the database and compare, like SQL Server's ledger
verification procedure, raising `VerificationError` at the first discrepancy.

Checked, in one consistent read snapshot:
1. entries are gapless 0..size-1 (size from the head row), each leaf is canonical, its stored leaf
   hash is RFC 6962's, and every queryable copy (kind, scope tag, request id, time, block links,
   command links) matches the leaf;
2. every stored subtree hash equals the recomputed one, and none is missing or extra;
3. every payload opens its leaf's commitment; a missing payload has a `payload.erase` record;
4. every checkpoint is signed by a trusted key, names this origin, matches its row (its size is its
   key), chains to the one before it (the head names the last), and its root is the recomputed
   root of that prefix of the log;
5. with `max_unsigned_age`, no entry older than that lies beyond the latest checkpoint: entries no
   checkpoint covers are protected by the database alone (a ledger with no checkpoint at all
   passed before; issue 12, item 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import sqlalchemy as sa

from kvguard.audit import merkle, note
from kvguard.audit import schema as t
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.events import EventKind
from kvguard.audit.leaf import command_links, decode_leaf, format_micros
from kvguard.audit.payloads import check_commitment
from kvguard.audit.selection import ts_micros
from kvguard.audit.store import blob
from kvguard.errors import VerificationError

if TYPE_CHECKING:
    from kvguard.audit.ledger import Ledger

_CHUNK = 5_000
Progress = Callable[[int, int], None]  # (entries scanned, entries in the log)


@dataclass(frozen=True)
class VerifyReport:
    size: int
    root: bytes
    checkpoints: int
    payloads: int
    erased: int


@dataclass
class _Scan:
    leaf_hashes: list[bytes]
    commitments: dict[int, bytes]
    blocks: set[tuple[int, int]]
    commands: set[tuple[int, int]]
    erased: set[int]


def verify_ledger(
    ledger: Ledger,
    extra_verifiers: Sequence[str] = (),
    *,
    max_unsigned_age: timedelta | None = None,
    now: datetime | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    verifiers = ledger.verifiers() + [note.parse_verifier_key(v) for v in extra_verifiers]
    with ledger.store.engine.connect() as plain:
        conn = plain  # one snapshot for every check: REPEATABLE READ on PostgreSQL
        if plain.dialect.name == "postgresql":
            conn = plain.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            size = ledger.store.size(conn)
            scan = _check_entries(conn, size, progress)
            _check_blocks(conn, scan.blocks)
            _check_commands(conn, scan.commands)
            levels = merkle.tree_levels(scan.leaf_hashes)
            _check_hashes(conn, levels, size)
            payloads = _check_payloads(conn, scan)
            count = _check_checkpoints(conn, levels, size, ledger.origin, verifiers)
            if max_unsigned_age is not None:
                _check_unsigned_age(conn, size, max_unsigned_age, now or ledger.now())
    return VerifyReport(
        size, merkle.levels_prefix_root(levels, size), count, payloads, len(scan.erased)
    )


def _check_entries(conn: sa.Connection, size: int, progress: Progress | None = None) -> _Scan:
    e = t.entries.c
    stmt = sa.select(e.idx, e.leaf, e.leaf_hash, e.kind, e.scope_tag, e.request_id, e.ts_us)
    scan = _Scan([], {}, set(), set(), set())
    expected = 0
    for idx, raw_leaf, stored_hash, kind, scope_tag, request_id, ts_us in conn.execute(
        stmt.order_by(e.idx).execution_options(yield_per=_CHUNK)
    ):
        if idx != expected:
            raise VerificationError(f"entry {expected}: missing (next stored index is {idx})")
        leaf = blob(raw_leaf, f"entry {idx}: leaf")
        try:
            event, commitment = decode_leaf(leaf)
        except VerificationError as exc:
            raise VerificationError(f"entry {idx}: {exc}") from None
        if blob(stored_hash, f"entry {idx}: leaf hash") != merkle.leaf_hash(leaf):
            raise VerificationError(f"entry {idx}: stored leaf hash does not match the leaf")
        columns = (kind, scope_tag, request_id, ts_us)
        if columns != (event.kind, event.scope_tag, event.request_id, ts_micros(event.ts)):
            raise VerificationError(f"entry {idx}: index columns do not match the leaf")
        scan.leaf_hashes.append(merkle.leaf_hash(leaf))
        scan.blocks.update((b, idx) for b in event.block_ids)
        scan.commands.update((c, idx) for c in command_links(event.kind, event.details))
        if commitment is not None:
            scan.commitments[idx] = commitment
        if event.kind == EventKind.PAYLOAD_ERASE:
            erased = event.details.get("erased_index")
            if isinstance(erased, int) and not isinstance(erased, bool):
                scan.erased.add(erased)
        expected += 1
        if progress is not None and expected % _CHUNK == 0:
            progress(expected, size)
    if expected < size:
        raise VerificationError(f"entry {expected}: missing (the head row says {size} entries)")
    if expected > size:
        raise VerificationError(
            f"entries {size}..{expected - 1}: {expected - size} extra row(s) beyond the "
            f"{size} entries the head row counts (inserted behind the append path's back)"
        )
    return scan


def _check_blocks(conn: sa.Connection, expected: set[tuple[int, int]]) -> None:
    b = t.entry_blocks.c
    stored = _int_pairs(conn.execute(sa.select(b.block_id, b.idx)), "block link")
    if stored != expected:
        first = min(stored ^ expected, key=lambda pair: pair[1])
        raise VerificationError(f"entry {first[1]}: block links do not match the leaf")


def _check_commands(conn: sa.Connection, expected: set[tuple[int, int]]) -> None:
    c = t.entry_commands.c
    stored = _int_pairs(conn.execute(sa.select(c.command_id, c.idx)), "command link")
    if stored != expected:
        first = min(stored ^ expected, key=lambda pair: pair[1])
        raise VerificationError(f"entry {first[1]}: command links do not match the leaf")


def _int_pairs(rows: Iterable[Sequence[object]], what: str) -> set[tuple[int, int]]:
    """(id, entry index) link rows as integers; a value edited to text is named, not a crash."""
    out: set[tuple[int, int]] = set()
    for x, i in rows:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (x, i)):
            raise VerificationError(f"{what} ({x!r}, entry {i!r}) is not a pair of integers")
        out.add((int(x), int(i)))  # type: ignore[call-overload]
    return out


def _check_hashes(conn: sa.Connection, levels: list[list[bytes]], size: int) -> None:
    h = t.hashes.c
    seen = 0
    for key, value in conn.execute(
        sa.select(h.id, h.hash).order_by(h.id).execution_options(yield_per=_CHUNK)
    ):
        level, index = merkle.split_stored_hash_key(int(key))
        if level == 0 or (index + 1) << level > size:
            raise VerificationError(f"stored hash {level}/{index} is not a complete subtree")
        if blob(value, f"stored hash {level}/{index}") != levels[level][index]:
            raise VerificationError(
                f"entries {index << level}..{((index + 1) << level) - 1}: stored subtree hash "
                f"(level {level}) does not match the recomputed one"
            )
        seen += 1
    want = sum(size >> level for level in range(1, size.bit_length()))
    if seen != want:
        raise VerificationError(f"{want - seen} stored subtree hashes are missing")


def _check_payloads(conn: sa.Connection, scan: _Scan) -> int:
    p = t.payloads.c
    present: set[int] = set()
    for idx, salt, body in conn.execute(sa.select(p.idx, p.salt, p.body).order_by(p.idx)):
        commitment = scan.commitments.get(int(idx))
        if commitment is None:
            raise VerificationError(f"entry {idx}: payload stored for a leaf without commitment")
        try:
            check_commitment(
                commitment, blob(salt, f"entry {idx}: salt"), blob(body, f"entry {idx}: payload")
            )
        except VerificationError as exc:
            raise VerificationError(f"entry {idx}: {exc}") from None
        present.add(int(idx))
    for idx in sorted(set(scan.commitments) - present - scan.erased):
        raise VerificationError(f"entry {idx}: payload deleted without a payload.erase record")
    for idx in sorted(present & scan.erased):  # put back (a backup restored) after its erasure
        raise VerificationError(
            f"entry {idx}: payload stored although a payload.erase entry names it"
        )
    return len(present)


def _check_unsigned_age(conn: sa.Connection, size: int, age: timedelta, now: datetime) -> None:
    signed = conn.execute(sa.select(t.head.c.checkpoint_size)).scalar_one_or_none() or 0
    if signed >= size:
        return
    e = t.entries.c
    oldest = conn.execute(sa.select(sa.func.min(e.ts_us)).where(e.idx >= signed)).scalar_one()
    if oldest is not None and oldest < ts_micros(now - age):
        raise VerificationError(
            f"entries {signed}..{size - 1} are covered by no checkpoint and the oldest is older "
            f"than {age} (at {format_micros(int(oldest))}): sign checkpoints regularly "
            "(checkpoint_interval) and publish them to auditors or witnesses"
        )


def _check_checkpoints(
    conn: sa.Connection,
    levels: list[list[bytes]],
    size: int,
    origin: str,
    verifiers: Sequence[note.Verifier],
) -> int:
    c = t.checkpoints.c
    rows = conn.execute(sa.select(c.size, c.root, c.note, c.prev_size).order_by(c.size)).all()
    latest = conn.execute(sa.select(t.head.c.checkpoint_size)).scalar_one_or_none()
    if latest != (rows[-1][0] if rows else None):
        raise VerificationError(
            f"the head names checkpoint size {latest}, the latest stored is "
            f"{rows[-1][0] if rows else None}: a checkpoint row was removed"
        )
    previous = None
    for cp_size, cp_root, signed, prev_size in rows:
        where = f"checkpoint of size {cp_size}"
        if prev_size != previous:
            raise VerificationError(
                f"{where}: chained to size {prev_size}, but the checkpoint "
                f"before it has size {previous}: a checkpoint row was removed"
            )
        previous = cp_size
        try:
            text, _ = note.open_note(str(signed), verifiers)
            cp = parse_checkpoint(text)
        except VerificationError as exc:
            raise VerificationError(f"{where}: {exc}") from None
        if cp.origin != origin:
            raise VerificationError(
                f"{where}: signed for origin {cp.origin!r}, not {origin!r} (the wrong --origin, "
                "or a checkpoint of another log)"
            )
        if (cp.size, cp.root) != (cp_size, blob(cp_root, f"{where}: root")):
            raise VerificationError(f"{where}: row does not match its signed note")
        if cp.size > size:
            raise VerificationError(
                f"{where}: signed size exceeds the {size} stored entries (the log was truncated)"
            )
        if merkle.levels_prefix_root(levels, cp.size) != cp.root:
            raise VerificationError(f"{where}: signed root differs from the recomputed root")
    return len(rows)
