"""Writing export bundles (format: `kvguard.audit.bundle`) from a ledger.

The exporter signs a fresh checkpoint first and proves every exported entry against it. A complete
export (no filter) rebuilds the whole tree from the leaves in memory and refuses to write anything
if it does not reproduce the signed root; a filtered export reads O(log n) stored hashes per entry and
checks each proof before writing it. Either way it never hands an auditor a bundle it could not
verify itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import sqlalchemy as sa

from kvguard.audit import bundle, merkle, note
from kvguard.audit import schema as t
from kvguard.audit.checkpoint import Checkpoint, format_tlog_proof, parse_checkpoint
from kvguard.audit.leaf import parse_ts, ts_micros
from kvguard.audit.query import select_indices
from kvguard.errors import AuditError, VerificationError

if TYPE_CHECKING:
    from kvguard.audit.ledger import Ledger


ProofFn = Callable[[int, bytes], list[bytes]]


@dataclass(frozen=True)
class ExportSummary:
    path: Path
    tree_size: int
    entries: int
    complete: bool
    checkpoint: str


def export_bundle(
    ledger: Ledger,
    out: Path,
    *,
    scope_tag: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    kinds: Sequence[str] | None = None,
    tlog_proofs: bool = False,
    renderings: bool = True,
    consistency: bool = True,
) -> ExportSummary:
    """Write a bundle of the matching entries to the new or empty directory `out`."""
    if out.exists() and any(out.iterdir()):
        raise AuditError(f"export directory {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    signed = ledger.checkpoint()
    cp = parse_checkpoint(note.split_note(signed)[0])
    filters: dict[str, Any] = {
        "scope_tag": scope_tag,
        "since": since,
        "until": until,
        "kinds": kinds,
    }
    complete = all(v is None for v in filters.values())
    (out / bundle.CHECKPOINT).write_text(signed, encoding="utf-8")
    with ledger.store.engine.connect() as conn, ExitStack() as files:
        proofs = _complete_proofs(conn, cp.size, cp.root) if complete else None
        writers = _open_outputs(out, files, renderings)
        count = 0
        for index, leaf in _rows(conn, filters, cp.size):
            proof = proofs(index, leaf) if proofs else _stored_proof(ledger, conn, index, cp, leaf)
            _write_entry(writers, index, leaf, proof, ledger.origin)
            if tlog_proofs:
                (out / bundle.PROOFS).mkdir(exist_ok=True)
                text = format_tlog_proof(index, proof, signed)
                (out / bundle.PROOFS / bundle.proof_name(index)).write_text(text, encoding="utf-8")
            count += 1
        if consistency:
            _write_consistency(ledger, conn, out, cp.size)
    return ExportSummary(out, cp.size, count, complete, signed)


def _open_outputs(out: Path, files: ExitStack, renderings: bool) -> dict[str, TextIO]:
    names = [bundle.ENTRIES, *([bundle.CSV, bundle.OCSF] if renderings else [])]
    writers: dict[str, TextIO] = {
        n: files.enter_context(open(out / n, "w", encoding="utf-8", newline=""))  # noqa: SIM115
        for n in names
    }
    if bundle.CSV in writers:
        writers[bundle.CSV].write(bundle.csv_header())
    return writers


def _write_entry(
    writers: dict[str, TextIO], index: int, leaf: bytes, proof: list[bytes], origin: str
) -> None:
    writers[bundle.ENTRIES].write(bundle.entry_line(index, leaf, [bundle.b64(h) for h in proof]))
    if bundle.CSV in writers:
        obj = json.loads(leaf)
        writers[bundle.CSV].write(bundle.csv_line(index, obj))
        writers[bundle.OCSF].write(bundle.ocsf_line(index, obj, origin))


def _rows(conn: sa.Connection, filters: dict[str, Any], size: int) -> Iterator[tuple[int, bytes]]:
    """Matching (index, leaf) rows. Each row's index columns are checked against its leaf, so a
    doctored column (which could hide an entry from a filtered export) stops the export."""
    e = t.entries.c
    stmt = select_indices(below=size, **filters).add_columns(
        e.kind, e.scope_tag, e.request_id, e.ts_us
    )
    for idx, leaf, *columns in conn.execute(stmt.execution_options(yield_per=5_000)):
        try:
            obj = json.loads(leaf)
            expected = [
                obj["kind"],
                obj["scope_tag"],
                obj["request_id"],
                ts_micros(parse_ts(obj["ts"])),
            ]
        except (ValueError, KeyError, TypeError):
            raise VerificationError(f"entry {idx}: leaf is not a valid event") from None
        if columns != expected:
            raise VerificationError(f"entry {idx}: index columns do not match the leaf")
        yield int(idx), bytes(leaf)


def _complete_proofs(conn: sa.Connection, size: int, root: bytes) -> ProofFn:
    """Build the tree from the stored leaf hashes; each proof call re-checks its leaf's hash."""
    e = t.entries.c
    stmt = sa.select(e.leaf_hash).where(e.idx < size).order_by(e.idx)
    levels = merkle.tree_levels(
        bytes(h) for (h,) in conn.execute(stmt.execution_options(yield_per=10_000))
    )
    if len(levels[0]) != size or merkle.levels_root(levels) != root:
        raise VerificationError("the stored entries do not reproduce the signed root: run verify()")

    def proof(index: int, leaf: bytes) -> list[bytes]:
        if merkle.leaf_hash(leaf) != levels[0][index]:
            raise VerificationError(f"entry {index}: leaf does not match its stored hash")
        return merkle.levels_inclusion_proof(levels, index)

    return proof


def _stored_proof(
    ledger: Ledger, conn: sa.Connection, index: int, cp: Checkpoint, leaf: bytes
) -> list[bytes]:
    size, root = cp.size, cp.root
    proof = merkle.hashes_for_ranges(
        merkle.inclusion_ranges(index, size), ledger.store.reader(conn)
    )
    merkle.verify_inclusion(index, size, merkle.leaf_hash(leaf), proof, root)
    return proof


def _write_consistency(ledger: Ledger, conn: sa.Connection, out: Path, size: int) -> None:
    lines = consistency_lines(ledger, conn, size)
    if lines:
        (out / bundle.CONSISTENCY).write_text("".join(lines), encoding="utf-8", newline="")


def consistency_lines(ledger: Ledger, conn: sa.Connection, size: int) -> list[str]:
    """`consistency.jsonl` lines from every stored checkpoint of 0 < size' < `size`, after checking
    the stored chain (each row matches its note and names its predecessor)."""
    latest: dict[int, str] = {}
    previous = None
    for row in ledger.store.checkpoints(conn):
        cp = parse_checkpoint(note.split_note(row.note)[0])
        if (cp.origin, cp.size, cp.root, row.prev_size) != (
            ledger.origin,
            row.size,
            row.root,
            previous,
        ):
            raise VerificationError(
                f"stored checkpoint of size {row.size} does not match its note or its predecessor"
            )
        previous = row.size
        if 0 < row.size < size:
            latest[row.size] = row.note
    reader = ledger.store.reader(conn)
    return [
        bundle.consistency_line(
            latest[old], merkle.hashes_for_ranges(merkle.consistency_ranges(old, size), reader)
        )
        for old in sorted(latest)
    ]
