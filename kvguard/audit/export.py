"""Writing export bundles (format: `kvguard.audit.bundle`) from a ledger.

The exporter signs a fresh checkpoint first and proves every exported entry against it. A complete
export (no filter) rebuilds the whole tree from the leaves in memory and refuses to write anything
if it does not reproduce the signed root; a filtered export reads O(log n) stored hashes per entry and
checks each proof before writing it. Consistency proofs from older checkpoints are verified before
they are written, and the payload of every exported commitment is written or its erasure proven
(`kvguard.audit.payloads`; a payload deleted without a record stops the export). Last, a manifest
signed by the log names the selection, the entry count and every file's digest
(`kvguard.audit.manifest`). Either way it never hands an auditor a bundle it could not verify
itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import sqlalchemy as sa

from kvguard.audit import bundle, merkle, note, payloads
from kvguard.audit import schema as t
from kvguard.audit.bundle import CHECKPOINT
from kvguard.audit.checkpoint import Checkpoint, format_tlog_proof, parse_checkpoint
from kvguard.audit.checkpoint_rows import retired_key_row
from kvguard.audit.leaf import parse_ts
from kvguard.audit.manifest import MANIFEST, Manifest, file_digest, format_manifest, selection_text
from kvguard.audit.query import select_indices
from kvguard.audit.selection import Selection, ts_micros
from kvguard.audit.store import CheckpointRow, blob
from kvguard.errors import AuditError, LogRewrittenError, SecretFileError, VerificationError
from kvguard.logging import get_logger
from kvguard.secretfile import open_private, private_dir, write_private_file

if TYPE_CHECKING:
    from kvguard.audit.ledger import Ledger


_log = get_logger("kvguard.audit.export")

ProofFn = Callable[[int, bytes], list[bytes]]
Progress = Callable[[int, int], None]  # (entries written, total or 0 when a filter hides it)

_PROGRESS_EVERY = 5_000  # entries between progress calls: keeps the callback off the per-entry path


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
    progress: Progress | None = None,
) -> ExportSummary:
    """Write a bundle of the matching entries to the new or empty directory `out`. A complete
    export always carries its consistency proofs (`consistency` applies to filtered ones).
    `progress(done, total)` is called every few thousand entries (`kvguard audit export`).

    The bundle is written into a private directory beside `out` and renamed into place when it
    is whole: an export that fails or is interrupted (Ctrl-C, SIGTERM, a database error) leaves
    no partial bundle at `out`, which a later export would refuse as not empty."""
    if out.is_symlink():
        raise SecretFileError(f"{out} is a symbolic link; give the directory itself")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AuditError(f"export directory {out} is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    # mkdtemp: 0700 from the start (evidence: 0700 directory, 0600 files, issue 13, item 2).
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        summary = _export_into(
            ledger,
            work,
            filters={"scope_tag": scope_tag, "since": since, "until": until, "kinds": kinds},
            tlog_proofs=tlog_proofs,
            renderings=renderings,
            consistency=consistency,
            progress=progress,
        )
        if out.exists():
            out.rmdir()  # empty (checked above); the rename takes its place
        os.rename(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return ExportSummary(
        out, summary.tree_size, summary.entries, summary.complete, summary.checkpoint
    )


def _export_into(
    ledger: Ledger,
    out: Path,
    *,
    filters: dict[str, Any],
    tlog_proofs: bool,
    renderings: bool,
    consistency: bool,
    progress: Progress | None,
) -> ExportSummary:
    """`export_bundle`'s work, into the (new, private) directory `out`."""
    signed = ledger.checkpoint()
    cp = parse_checkpoint(note.split_note(signed)[0])
    complete = all(v is None for v in filters.values())
    write_private_file(out / bundle.CHECKPOINT, signed)
    committed: list[tuple[int, bytes]] = []
    with ledger.store.engine.connect() as conn, ExitStack() as files:
        proofs = _complete_proofs(conn, cp.size, cp.root) if complete else None
        writers = _open_outputs(out, files, renderings)
        count = 0
        for row in _rows(conn, filters, cp.size, complete=complete):
            index, leaf, event = row
            proof = proofs(index, leaf) if proofs else _stored_proof(ledger, conn, index, cp, leaf)
            _write_entry(writers, row, proof, ledger.origin)
            if tlog_proofs:
                private_dir(out / bundle.PROOFS)
                text = format_tlog_proof(index, proof, signed)
                write_private_file(out / bundle.PROOFS / bundle.proof_name(index), text)
            commitment = payloads.commitment_in_leaf(leaf) if event is not None else None
            if commitment is not None:
                committed.append((index, commitment))
            count += 1
            if progress is not None and count % _PROGRESS_EVERY == 0:
                progress(count, cp.size if complete else 0)
        if consistency or complete:
            _write_consistency(ledger, conn, out, cp)
        lines = payload_lines(ledger, conn, committed, cp)
        write_private_file(out / payloads.PAYLOADS, "".join(lines))
    if progress is not None:
        progress(count, count)
    manifest = Manifest(
        ledger.origin,
        cp.size,
        cp.root,
        selection_text(None if complete else filters),
        count,
        {p.name: file_digest(p) for p in out.iterdir() if p.is_file() and p.name != CHECKPOINT},
        count if tlog_proofs else 0,
    )
    write_private_file(out / MANIFEST, ledger.sign_note(format_manifest(manifest)))
    return ExportSummary(out, cp.size, count, complete, signed)


def payload_lines(
    ledger: Ledger,
    conn: sa.Connection,
    committed: Sequence[tuple[int, bytes]],
    cp: Checkpoint,
) -> list[str]:
    """`payloads.jsonl` lines for the exported entries with a commitment (index order): present
    (its stored payload opened the commitment; the payload itself never leaves, G6), or the
    `payload.erase` entry naming it with its inclusion proof. A commitment with neither is a
    payload deleted behind the log's back: VerificationError, nothing exported."""
    if not committed:
        return []
    p = t.payloads.c
    wanted = [i for i, _ in committed]
    stored: dict[int, tuple[bytes, bytes]] = {}
    for start in range(0, len(wanted), 500):
        chunk = wanted[start : start + 500]
        for idx, salt, body in conn.execute(
            sa.select(p.idx, p.salt, p.body).where(p.idx.in_(chunk))
        ):
            stored[int(idx)] = (bytes(salt), bytes(body))
    erasures = _erasures(conn, cp.size)
    reader = ledger.store.complete_reader(conn)
    out = []
    for index, commitment in committed:
        if index in stored and index in erasures:  # put back after its erasure: never "present"
            raise VerificationError(
                f"entry {index}: payload stored although a payload.erase entry names it: run "
                "verify-db"
            )
        if index in stored:
            salt, body = stored[index]
            payloads.check_commitment(commitment, salt, body)
            out.append(payloads.present_line(index))
            continue
        if index not in erasures:
            raise VerificationError(
                f"entry {index}: payload deleted without a payload.erase record: run verify-db"
            )
        by, leaf = erasures[index]
        proof = merkle.hashes_for_ranges(merkle.inclusion_ranges(by, cp.size), reader)
        merkle.verify_inclusion(by, cp.size, merkle.leaf_hash(leaf), proof, cp.root)
        out.append(payloads.erased_line(index, by, leaf, proof))
    return out


def _erasures(conn: sa.Connection, size: int) -> dict[int, tuple[int, bytes]]:
    """erased index -> (index, leaf) of the first `payload.erase` entry naming it (below `size`)."""
    e = t.entries.c
    stmt = sa.select(e.idx, e.leaf).where(e.kind == payloads.ERASE_KIND, e.idx < size)
    found: dict[int, tuple[int, bytes]] = {}
    for idx, raw in conn.execute(stmt.order_by(e.idx)):
        named = payloads.erased_index(bytes(raw))
        if named is not None:
            found.setdefault(named, (int(idx), bytes(raw)))
    return found


def _open_outputs(out: Path, files: ExitStack, renderings: bool) -> dict[str, TextIO]:
    names = [bundle.ENTRIES, *([bundle.CSV, bundle.OCSF] if renderings else [])]
    writers: dict[str, TextIO] = {n: files.enter_context(open_private(out / n)) for n in names}
    if bundle.CSV in writers:
        writers[bundle.CSV].write(bundle.csv_header())
    return writers


def _write_entry(
    writers: dict[str, TextIO],
    row: tuple[int, bytes, dict[str, Any] | None],
    proof: list[bytes],
    origin: str,
) -> None:
    index, leaf, event = row
    proof_b64 = [bundle.b64(h) for h in proof]
    writers[bundle.ENTRIES].write(bundle.entry_line(index, leaf, proof_b64, foreign=event is None))
    if bundle.CSV in writers and event is not None:  # the renderings hold events only
        writers[bundle.CSV].write(bundle.csv_line(index, event))
        writers[bundle.OCSF].write(bundle.ocsf_line(index, event, origin))


def _rows(
    conn: sa.Connection, filters: dict[str, Any], size: int, *, complete: bool
) -> Iterator[tuple[int, bytes, dict[str, Any] | None]]:
    """Matching (index, leaf, event) rows; `event` is None for a foreign leaf (`bundle.leaf_event`).

    A filtered export selects on the leaves, not on the index columns, and checks every entry's
    columns against its leaf first: the columns are what a database query filters on, so a
    doctored one could hide an entry from the filter (a row moved *out* of a tenant's tag or a
    time range is never selected by a query on them; found by a review). This reads every entry
    below the checkpoint, the cost of a filtered export as of a complete one. A foreign leaf (a
    row some other writer put at the head) is not an event, so no filter selects it: a complete
    export carries it as `"event":null` (the tree needs every leaf), a filtered one leaves it
    out, with a warning."""
    e = t.entries.c
    stmt = select_indices(below=size).add_columns(e.kind, e.scope_tag, e.request_id, e.ts_us)
    selected = None if complete else _selector(filters)
    for idx, raw, *columns in conn.execute(stmt.execution_options(yield_per=5_000)):
        leaf = blob(raw, f"entry {idx}: leaf")
        event = bundle.leaf_event(leaf)
        if event is None:
            _log.warning("ledger entry is not a kvguard event (written outside kvguard)", index=idx)
            if complete:
                yield int(idx), leaf, None
            continue
        if selected is None:  # a complete export selects on no column: a doctored one hides nothing
            yield int(idx), leaf, event
            continue
        ts = ts_micros(parse_ts(event["ts"]))
        if columns != [event["kind"], event["scope_tag"], event["request_id"], ts]:
            raise VerificationError(f"entry {idx}: index columns do not match the leaf")
        if selected.holds(event["scope_tag"], event["kind"], ts):
            yield int(idx), leaf, event


def _selector(filters: dict[str, Any]) -> Selection:
    """The selection of `kvguard.audit.query.select_indices`'s filters, read off the leaves."""
    return Selection.of(
        scope_tag=filters.get("scope_tag"),
        kinds=filters.get("kinds"),
        since=filters.get("since"),
        until=filters.get("until"),
    )


def _complete_proofs(conn: sa.Connection, size: int, root: bytes) -> ProofFn:
    """Build the tree from the stored leaf hashes; each proof call re-checks its leaf's hash."""
    e = t.entries.c
    stmt = sa.select(e.idx, e.leaf_hash).where(e.idx < size).order_by(e.idx)
    levels = merkle.tree_levels(
        blob(h, f"entry {i}: leaf hash")
        for i, h in conn.execute(stmt.execution_options(yield_per=10_000))
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
        merkle.inclusion_ranges(index, size), ledger.store.complete_reader(conn)
    )
    merkle.verify_inclusion(index, size, merkle.leaf_hash(leaf), proof, root)
    return proof


def _write_consistency(ledger: Ledger, conn: sa.Connection, out: Path, cp: Checkpoint) -> None:
    """Always written (maybe empty): the manifest then says the bundle carries its consistency
    data, and the verifier can require it of a complete bundle."""
    lines = consistency_lines(ledger, conn, cp.size, cp.root)
    write_private_file(out / bundle.CONSISTENCY, "".join(lines))


def _check_unsigned_row(
    ledger: Ledger, conn: sa.Connection, row: CheckpointRow, problem: str
) -> bool:
    """True for a row this log signed with a key it no longer holds (kept:
    `checkpoint_rows.retired_key_row`).
    Otherwise the row is left out (False, a warning naming its size): a row the log's keys do not
    verify proves nothing, and anyone with INSERT on the table can add one, also with the log's
    true root (every checkpoint publishes it), so refusing the export for it would let one INSERT
    stop every later export. `verify-db` reports such rows. Refused: a row whose note this log
    signed for the row's own size but with another root (only an UPDATE makes that: the app role
    cannot INSERT a second row at a size), as `verify()` refuses it."""
    if retired_key_row(ledger.store, conn, row, origin=ledger.origin, ours=ledger.verifiers()):
        return True  # signed before a key rotation: auditors with that verifier key check it
    try:
        cp = parse_checkpoint(note.open_note(row.note, ledger.verifiers())[0])
    except VerificationError:
        cp = None
    if cp is not None and cp.size == row.size:
        raise VerificationError(
            f"stored checkpoint of size {row.size} does not match its signed note: run verify-db"
        )
    _log.warning(
        "export: stored checkpoint row left out, not one this log signed (verify-db reports it)",
        size=row.size,
        reason=problem,
    )
    return False


def consistency_lines(ledger: Ledger, conn: sa.Connection, size: int, root: bytes) -> list[str]:
    """`consistency.jsonl` lines from every stored checkpoint of 0 < size' < `size` that this log
    signed, after checking the stored chain (each row names its predecessor) and each proof against
    the new `root`: a proof that does not verify is a rewritten log, reported here instead of
    reaching the auditor as a false "forked log". A row whose note the log's keys do not verify
    (anyone with INSERT on the table can add one) is left out with a warning naming its size: it
    proves nothing, and must not stop every later export."""
    latest: dict[int, str] = {}
    previous = None
    for row in ledger.store.checkpoints(conn):
        if row.prev_size != previous:
            raise VerificationError(
                f"stored checkpoint of size {row.size} is chained to size {row.prev_size}, the "
                f"one before it has size {previous}: a checkpoint row was removed"
            )
        previous = row.size
        problem = ledger.checkpoint_row_problem(row)
        if problem is not None and not _check_unsigned_row(ledger, conn, row, problem):
            continue
        if 0 < row.size < size:
            latest[row.size] = row.note
    reader = ledger.store.complete_reader(conn)
    out = []
    for old in sorted(latest):
        proof = merkle.hashes_for_ranges(merkle.consistency_ranges(old, size), reader)
        old_root = parse_checkpoint(note.split_note(latest[old])[0]).root
        try:
            merkle.verify_consistency(old, size, old_root, root, proof)
        except VerificationError as exc:
            raise LogRewrittenError(
                f"the log no longer extends its checkpoint of size {old} ({exc}): "
                "run `kvguard audit verify-db`"
            ) from None
        out.append(bundle.consistency_line(latest[old], proof))
    return out
