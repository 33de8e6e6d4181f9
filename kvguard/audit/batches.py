"""The background writer's batches, appended exactly once across retries.

The writer keeps a batch and retries it after any failure (`kvguard.audit.writer`). A failure can
come after the database committed: the connection drops while the COMMIT's answer is on its way, and
the client sees an error for a transaction that stands. Retrying then appended every entry of the
batch a second time (found by a review: leaves n0..n4, n0..n4); the tree still verified, and
figures summed from the log (blocks cleared, purges) were inflated with nothing to flag them.

So each queued entry is prepared once (leaf bytes, leaf hash: a payload's commitment salt is random
and would differ if prepared again) and kept until it is durable, and after a failed attempt the next
one first looks at the log's tail, from the size this process last knew to be durable: the entries
of the failed batch that are there (it committed as a whole or not at all, in queue order, at its
head) count as appended, and only the rest is appended.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from kvguard.audit import schema as t
from kvguard.audit.events import AuditEvent
from kvguard.audit.leaf import prepare_entry
from kvguard.audit.store import LedgerStore, PreparedEntry
from kvguard.audit.writer import Entry
from kvguard.logging import get_logger

_log = get_logger("kvguard.audit.batches")


class BatchAppender:
    """`BackgroundWriter`'s write function for one ledger store (one writer thread calls it)."""

    def __init__(self, store: LedgerStore) -> None:
        self._store = store
        self._prepared: dict[int, tuple[Entry, list[PreparedEntry]]] = {}
        self._durable: int | None = None  # the log's size after this process's last append
        self._uncertain = False  # an attempt failed: it may have committed all the same

    def __call__(self, entries: Sequence[Entry]) -> None:
        prepared = [p for entry in entries for p in self._prepare(entry)]
        if self._durable is None:
            self._durable = self._store.size()
        if self._uncertain:
            landed = self._landed(prepared)
            if landed:
                _log.warning(
                    "ledger batch committed before its write failed; not appended again",
                    entries=landed,
                )
            prepared = prepared[landed:]
        try:
            first = self._store.append(prepared) if prepared else self._durable
        except BaseException:
            self._uncertain = True
            raise
        self._uncertain = False
        self._durable = first + len(prepared)
        for entry in entries:
            self._prepared.pop(id(entry), None)

    def _prepare(self, entry: Entry) -> list[PreparedEntry]:
        kept = self._prepared.get(id(entry))
        if kept is not None and kept[0] is entry:
            return kept[1]
        events = [entry] if isinstance(entry, AuditEvent) else entry.audit_events()
        prepared = [prepare_entry(event) for event in events]
        self._prepared[id(entry)] = (entry, prepared)  # the entry kept alive: its id stays its own
        return prepared

    def _landed(self, prepared: list[PreparedEntry]) -> int:
        """How many of `prepared`, from the first, a failed attempt committed: the run of their
        leaf hashes found in the log at or after the size last known durable (other writers'
        entries may come before it, never inside it: an append holds the head lock)."""
        if not prepared:
            return 0
        with self._store.engine.connect() as conn:
            tail = conn.execute(
                sa.select(t.LedgerEntry.leaf_hash)
                .where(t.LedgerEntry.idx >= self._durable)
                .order_by(t.LedgerEntry.idx)
            ).scalars()
            hashes = [bytes(h) for h in tail]
        try:
            start = hashes.index(prepared[0].leaf_hash)
        except ValueError:
            return 0
        landed = 0
        for ours, stored in zip(prepared, hashes[start:], strict=False):
            if ours.leaf_hash != stored:
                break
            landed += 1
        return landed
