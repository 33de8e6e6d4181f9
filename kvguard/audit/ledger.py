"""`Ledger`: the audit log facade that engines, the policy layer and the admin API use.

Ownership: the ledger owns its tables (through `LedgerStore`), its background writer and its signing
keys; it never holds tenant secrets or KV payloads (G6 is enforced by `AuditEvent` validation).

Durability contract: `append` / `append_many` return only after their transaction committed with
the database's durable setting (`kvguard.audit.db`); `submit` returns at once and `flush` waits
until everything submitted before it is durable.

Checkpoints: `checkpoint()` signs a C2SP tlog-checkpoint of the current tree only once it has
proven what it signs (issue 12, item 3): the RFC 9162 consistency proof from the previous signed
checkpoint, with every proof hash over entries appended since then recomputed from their stored
leaf hashes (the older ones are vouched for by the previous root), must reproduce the root the
stored subtree hashes give. The first checkpoint recomputes the whole root from the leaf hashes. A
corrupted stored hash (the frontier) or a history that contradicts a signed one is refused and
reported, never signed.

What it proves from: only stored checkpoint rows whose note verifies under the log's own keys and
names this origin, size and root count as "signed" (a row the app role may INSERT, chained and
within the log, with a note nobody signed, is skipped, counted in one line per search, so it
cannot stop later checkpoints); and the (size, root) this process last signed, kept in memory, so that a
database superuser who deletes the checkpoint rows and rewrites history consistently still cannot
get this signer to sign a second root for a size it signed (a fork). A restarted process has only
the stored rows, the witnesses and the auditors' kept checkpoints to go by.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from kvguard.audit import merkle, note
from kvguard.audit import schema as t
from kvguard.audit.batches import BatchAppender
from kvguard.audit.checkpoint import Checkpoint, format_checkpoint, parse_checkpoint
from kvguard.audit.checkpoint_rows import SkippedRows, stranger_signed
from kvguard.audit.db import create_engine, read_connection, write_transaction
from kvguard.audit.events import AuditEvent, EventKind
from kvguard.audit.export import ExportSummary, export_bundle
from kvguard.audit.leaf import prepare_entry
from kvguard.audit.migrate import upgrade
from kvguard.audit.payloads import ErasureReason
from kvguard.audit.query import QueryPage, run_query
from kvguard.audit.signing import SigningKey
from kvguard.audit.store import CheckpointRow, LedgerStore
from kvguard.audit.timemarks import TimeMarks
from kvguard.audit.verify_db import VerifyReport, verify_ledger
from kvguard.audit.witness_client import CosignOutcome, WitnessEndpoint, request_cosignatures
from kvguard.audit.witness_client import Status as WitnessStatus
from kvguard.audit.writer import BackgroundWriter, Entry, Overflow, PeriodicTask, check_nice
from kvguard.errors import AuditError, LogRewrittenError, VerificationError
from kvguard.logging import get_logger

_log = get_logger("kvguard.audit.ledger")

Clock = Callable[[], datetime]

_OTHER_ORIGIN = "signed for origin"


def utc_now() -> datetime:
    return datetime.now(UTC)


class Ledger:
    """A tamper-evident, append-only audit log in SQL (see the module docstring)."""

    def __init__(
        self,
        store: LedgerStore,
        *,
        origin: str,
        signing_keys: Sequence[SigningKey],
        clock: Clock,
        writer: BackgroundWriter,
    ) -> None:
        if not signing_keys:
            raise AuditError("a ledger needs at least one checkpoint signing key")
        self.store = store
        self.origin = origin
        self.signing_keys = list(signing_keys)
        self._clock = clock
        self._writer = writer
        self._periodic: PeriodicTask | None = None
        self.time_marks = TimeMarks()  # per-chunk ts bounds for time-range queries (cached)
        self.witnesses: list[WitnessEndpoint] = []
        self._witness_sizes: dict[str, int] = {}  # witness name -> size it last cosigned
        self.last_cosigning: CosignOutcome | None = None
        # The (size, root) this process last signed: a fork is refused even when the stored
        # checkpoint rows are gone (module docstring). Guarded by `_anchor_lock`.
        self._anchor: tuple[int, bytes] | None = None
        self._anchor_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        url: str,
        *,
        origin: str,
        signing_key: SigningKey | Sequence[SigningKey],
        clock: Clock = utc_now,
        overflow: Overflow | str = Overflow.BLOCK,
        queue_capacity: int = 100_000,
        batch_size: int = 1_000,
        batch_interval: float = 0.05,
        checkpoint_interval: float | None = None,
        witnesses: Sequence[WitnessEndpoint] = (),
        writer_nice: int = 0,
    ) -> Ledger:
        """Open (creating or upgrading the schema) the ledger at `url`.

        `signing_key` may be several keys during a rotation: each checkpoint then carries one
        signature line per key. `checkpoint_interval` (seconds) starts periodic checkpoints.
        `witnesses`: c2sp.org/tlog-witness endpoints every checkpoint is submitted to; the note
        `checkpoint()` returns carries the cosignatures they gave. `writer_nice` lowers the group
        commits' thread priority (`kvguard.audit.writer.lower_thread_priority`).
        """
        if not origin or "\n" in origin:
            raise AuditError("a ledger origin is one non-empty line (C2SP tlog-checkpoint)")
        check_nice(writer_nice)  # before the database is touched
        keys = [signing_key] if isinstance(signing_key, SigningKey) else list(signing_key)
        if not keys:
            raise AuditError("a ledger needs at least one checkpoint signing key")
        engine = create_engine(url)
        upgrade(engine)
        store = LedgerStore(engine)
        writer = BackgroundWriter(
            BatchAppender(store),  # exactly once, also when a commit's answer is lost
            capacity=queue_capacity,
            batch_size=batch_size,
            interval=batch_interval,
            overflow=Overflow(overflow),
            nice=writer_nice,
        )
        ledger = cls(store, origin=origin, signing_keys=keys, clock=clock, writer=writer)
        ledger.witnesses = list(witnesses)
        if checkpoint_interval is not None:
            ledger._periodic = PeriodicTask(
                checkpoint_interval, ledger._periodic_checkpoint, "kvguard-ledger-checkpoint"
            )
        return ledger

    # -- writing -------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The number of durable entries (the tree size)."""
        return self.store.size()

    def append(self, event: AuditEvent) -> int:
        """Append one event; returns its index once durable."""
        return self.append_many([event])[0]

    def append_many(self, events: Sequence[AuditEvent]) -> list[int]:
        """Append events in one transaction; returns their (consecutive) indices once durable."""
        if not events:
            return []
        first = self.store.append([prepare_entry(e) for e in events])
        return list(range(first, first + len(events)))

    def submit(self, event: Entry) -> None:
        """Queue `event` (an `AuditEvent` or an `EventSource` built on the writer thread) for a group
        commit without waiting (see `kvguard.audit.writer`)."""
        self._writer.submit(event)

    def refusing(self) -> bool:
        """Whether a submission would be refused, or have to wait, now
        (`BackgroundWriter.refusing`)."""
        return self._writer.refusing()

    def submit_many(self, events: Sequence[Entry], *, wait: bool = True) -> None:
        """Queue several events at once, in order (one lock round trip for an engine step);
        `wait=False`: refused rather than waiting for room (`BackgroundWriter.submit_many`)."""
        self._writer.submit_many(events, wait=wait)

    def flush(self, timeout: float | None = 30.0) -> None:
        """Wait until every submitted event is durable."""
        self._writer.flush(timeout)

    def close(self) -> None:
        """Flush, stop background threads and release connections."""
        if self._periodic is not None:
            self._periodic.stop()
        self._writer.close()
        self.store.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def erase_payload(self, index: int, *, reason: ErasureReason | str) -> int:
        """Delete the erasable payload of entry `index` and its commitment salt, and record the
        erasure as a new `payload.erase` entry in the same transaction; returns that entry's index.

        `reason` is an `ErasureReason` code (a leaf is kept forever: no free text in it). The
        record carries the erased entry's scope tag, so the tenant's own export holds it. The leaf
        (and so every proof and checkpoint) is unchanged: it only ever held the salted commitment,
        which cannot be opened once the salt is gone.
        """
        try:
            code = ErasureReason(reason)
        except ValueError:
            codes = ", ".join(r.value for r in ErasureReason)
            raise AuditError(f"unknown erasure reason {reason!r}; use one of: {codes}") from None
        with self.store.engine.connect() as conn:
            found = conn.execute(
                sa.select(t.entries.c.scope_tag).where(t.entries.c.idx == index)
            ).first()
        if found is None:
            raise AuditError(f"entry {index} does not exist")
        event = AuditEvent(
            kind=EventKind.PAYLOAD_ERASE,
            ts=self._clock(),
            scope_tag=found[0],
            details={"erased_index": index, "reason": code.value},
        )

        def delete(conn: sa.Connection, _first: int) -> None:
            gone = conn.execute(sa.delete(t.payloads).where(t.payloads.c.idx == index)).rowcount
            if gone != 1:
                raise AuditError(f"entry {index} has no erasable payload (already erased?)")

        recorded = self.store.append([prepare_entry(event)], after=delete)
        _log.info("ledger payload erased", erased_index=index, record_index=recorded)
        return recorded

    def sign_note(self, text: str) -> str:
        """`text` as a signed note by every signing key of the log (export manifests)."""
        return note.join_note(text, [k.signature_line(text) for k in self.signing_keys])

    # -- checkpoints and proofs ----------------------------------------------------------------

    def verifiers(self) -> list[note.Verifier]:
        return [k.verifier() for k in self.signing_keys]

    def checkpoint(self) -> str:
        """Sign and store a checkpoint of the current tree, then have the configured witnesses
        cosign it; returns the signed note text (with the cosignatures obtained)."""
        signed = self._sign_checkpoint()
        return self._cosign(signed) if self.witnesses else signed

    def checkpoint_recorded(self, request: AuditEvent) -> str:
        """`checkpoint()` of a checkpoint someone asked for: `request` (who asked) is appended and
        the checkpoint signed over the tree that ends with it, in one transaction (the erasure's
        pattern), so the signed checkpoint covers its own request (index = tree size - 1) and
        neither is stored without the other: an append that fails refuses the checkpoint."""
        signed: list[tuple[str, int, bytes]] = []

        def sign(conn: sa.Connection, first: int) -> None:
            signed.append(self._sign_locked(conn, first + 1))

        self.store.append([prepare_entry(request)], after=sign)
        text, size, root = signed[0]
        self._advance_anchor(size, root)
        return self._cosign(text) if self.witnesses else text

    def _cosign(self, signed: str) -> str:
        """Submit `signed` to every witness (outside any transaction: HTTP may be slow). A witness
        that is down or refuses does not fail the checkpoint; a refusal is logged as an error,
        because a witness refuses only a checkpoint that contradicts one it cosigned (a fork)."""
        outcome = request_cosignatures(
            self.witnesses, signed, self.consistency_proof, self._witness_sizes
        )
        self._witness_sizes.update(outcome.known_sizes())
        self.last_cosigning = outcome
        for name, result in outcome.witnesses.items():
            if result.status is WitnessStatus.CONFLICT:
                _log.error(
                    "ledger checkpoint refused by a witness", witness=name, reason=result.reason
                )
            elif result.status is not WitnessStatus.OK:
                _log.warning("ledger checkpoint not cosigned", witness=name, reason=result.reason)
        return outcome.note

    def _sign_checkpoint(self) -> str:
        with write_transaction(self.store.engine) as conn:
            text, size, root = self._sign_locked(conn, self.store.lock_head(conn))
        self._advance_anchor(size, root)
        return text

    def _sign_locked(self, conn: sa.Connection, size: int) -> tuple[str, int, bytes]:
        """Prove and sign the tree of `size` inside `conn`'s transaction, whose caller holds the
        head row lock; stores the checkpoint unless one of that size exists. Returns (signed note,
        size, root); the in-memory anchor moves only once the caller has committed."""
        root = self.store.root(size, conn)
        trusted = self.trusted_checkpoint(conn)
        with self._anchor_lock:
            anchor = self._anchor
        try:
            if trusted is not None:
                self._prove_root(conn, trusted.size, trusted.root, size, root)
            elif anchor is None:  # nothing vouched for yet: the whole root from the leaf hashes
                self._recompute(conn, 0, size, root)
            if anchor is not None and anchor != ((trusted.size, trusted.root) if trusted else None):
                self._prove_root(conn, anchor[0], anchor[1], size, root, in_memory=True)
        except VerificationError as exc:
            _log.error("ledger checkpoint refused", origin=self.origin, size=size, reason=str(exc))
            raise
        text = format_checkpoint(Checkpoint(self.origin, size, root))
        signed = self.sign_note(text)
        last = self.store.latest_checkpoint(conn)  # the chain's end, trusted or not
        if last is None or last.size < size:  # one stored checkpoint per size: the first
            prev = last.size if last is not None else None
            self.store.insert_checkpoint(conn, size, root, signed, prev)
            _log.info(
                "ledger checkpoint signed",
                origin=self.origin,
                size=size,
                key_ids=[k.key_id.hex() for k in self.signing_keys],
            )
        return signed, size, root

    def _advance_anchor(self, size: int, root: bytes) -> None:
        with self._anchor_lock:
            if self._anchor is None or self._anchor[0] <= size:
                self._anchor = (size, root)

    def trusted_checkpoint(self, conn: sa.Connection, *, log: bool = True) -> CheckpointRow | None:
        """The latest stored checkpoint row whose note verifies under this log's keys and names
        its origin, size and root; None if none does (the signer then recomputes the root from the
        leaf hashes once). Rows above it are skipped, never trusted, and never end the search (one
        signed by any key once did, so one INSERT made a fresh signer drop its anchor); a row
        signed by none of our keys is told by its signature lines alone, without recomputing a
        root under the head lock (`kvguard.audit.checkpoint_rows`). One line per search counts
        the skipped rows (`log`: readers serving checkpoints leave it to the signer)."""
        ours, skipped, found = self.verifiers(), SkippedRows(), None
        for row in self.store.checkpoints_newest_first(conn):
            problem = self.checkpoint_row_problem(row)
            if problem is None:
                found = row
                break
            stranger = stranger_signed(row.note, ours)
            if not stranger and problem.startswith(_OTHER_ORIGIN):  # our key: misconfigured
                raise VerificationError(
                    f"the stored checkpoint of size {row.size} is {problem}, and this ledger was "
                    f"opened as {self.origin!r} (the wrong origin?): refusing to sign"
                )
            skipped.add(row.size, problem, stranger=stranger)
        if log:
            skipped.log(_log)
        return found

    def checkpoint_row_problem(self, row: CheckpointRow) -> str | None:
        """Why stored checkpoint `row` is not one this log signed (None if it is)."""
        try:
            text, _ = note.open_note(row.note, self.verifiers())
            cp = parse_checkpoint(text)
        except VerificationError as exc:
            return str(exc)
        if cp.origin != self.origin:
            return f"{_OTHER_ORIGIN} {cp.origin!r}"
        if (cp.size, cp.root) != (row.size, row.root):
            return "the row does not match its signed note"
        return None

    def _prove_root(
        self,
        conn: sa.Connection,
        old_size: int,
        old_root: bytes,
        size: int,
        root: bytes,
        *,
        in_memory: bool = False,
    ) -> None:
        """Refuse to sign `root` unless it follows from the leaf hashes appended since the
        signed (`old_size`, `old_root`) and from that signed root (module docstring)."""
        what = "the checkpoint this process signed" if in_memory else "its checkpoint"
        if old_size > size:
            raise LogRewrittenError(
                f"tree shrank from {old_size} to {size} entries since {what}: refusing to sign"
            )
        if size == old_size:
            if root != old_root:
                raise LogRewrittenError(
                    f"the root of the first {size} entries changed since it was signed: "
                    f"refusing to sign (a fork of {what})"
                )
            return
        if old_size == 0:
            self._recompute(conn, 0, size, root)
            return
        ranges = merkle.consistency_ranges(old_size, size)
        proof = merkle.hashes_for_ranges(ranges, self.store.complete_reader(conn))
        for (lo, hi), kept in zip(ranges, proof, strict=True):
            if lo >= old_size:  # appended since; the older ranges are checked by the old root
                self._recompute(conn, lo, hi, kept)
        try:
            merkle.verify_consistency(old_size, size, old_root, root, proof)
        except VerificationError as exc:
            raise LogRewrittenError(
                f"the log no longer extends {what} of size {old_size} "
                f"(consistency proof: {exc}): refusing to sign"
            ) from None

    def _recompute(self, conn: sa.Connection, lo: int, hi: int, stored: bytes) -> None:
        """The hash of entries [lo, hi) from their leaf hashes must be `stored` (from the stored
        subtree hashes); else the frontier is corrupted and nothing is signed."""
        levels = merkle.tree_levels(self.store.leaf_hashes(conn, lo, hi))
        if merkle.levels_root(levels) != stored:
            _log.error("ledger checkpoint refused: stored subtree hashes are corrupted", first=lo)
            raise VerificationError(
                f"entries {lo}..{hi - 1}: the stored subtree hashes do not reproduce the hash of "
                "their leaf hashes (a corrupted frontier): refusing to sign; run "
                "`kvguard audit verify-db`"
            )

    def _periodic_checkpoint(self) -> None:
        with self.store.engine.connect() as conn:
            last = self.trusted_checkpoint(conn)
        if last is None or last.size < self.size:
            self.checkpoint()

    def inclusion_proof(self, index: int, tree_size: int) -> list[bytes]:
        """RFC 9162 section 2.1.3.1 audit path for entry `index` in the tree of `tree_size`."""
        return self.store.hashes_for_ranges(merkle.inclusion_ranges(index, tree_size), tree_size)

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        """RFC 9162 section 2.1.4.1 proof that tree `old_size` is a prefix of tree `new_size`."""
        if old_size == new_size:
            self._check_size(new_size)
            return []
        return self.store.hashes_for_ranges(merkle.consistency_ranges(old_size, new_size), new_size)

    def root(self, tree_size: int) -> bytes:
        self._check_size(tree_size)
        with self.store.engine.connect() as conn:
            return self.store.root(tree_size, conn)

    def _check_size(self, tree_size: int) -> None:
        if not 0 <= tree_size <= self.size:
            raise ValueError(f"tree size {tree_size} is beyond the ledger ({self.size} entries)")

    # -- reading -------------------------------------------------------------------------------

    def query(self, *, limit: int = 100, **filters: Any) -> QueryPage:
        """Entries by `scope_tag` or `scope_tags`, `kinds`, `since`/`until`, `request_id`,
        `block_id`, paged by `after` (the previous page's `next_after`)."""
        with read_connection(self.store.engine) as conn:
            return run_query(conn, limit=limit, marks=self.time_marks, **filters)

    def export(self, path: str | Path, **options: Any) -> ExportSummary:
        """Write an export bundle: options `scope_tag`, `since`, `until`, `kinds`, `tlog_proofs`,
        `renderings`, `consistency`, `progress` (see
        `kvguard.audit.export.export_bundle`)."""
        return export_bundle(self, Path(path), **options)

    def verify(
        self,
        extra_verifiers: Sequence[str] = (),
        *,
        max_unsigned_age: timedelta | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> VerifyReport:
        """Recompute everything from the database (see `kvguard.audit.verify_db`); raises
        VerificationError naming the first failing entry. `extra_verifiers`: verifier key strings
        of retired signing keys whose checkpoints should still be accepted. `max_unsigned_age`:
        fail when an entry older than that is covered by no checkpoint. `progress(done, total)`:
        called every few thousand entries scanned."""
        return verify_ledger(
            self, extra_verifiers, max_unsigned_age=max_unsigned_age, progress=progress
        )

    def now(self) -> datetime:
        """The ledger's clock (injected: tests pass their own)."""
        return self._clock()
