"""The background writer's batches, appended exactly once across retries.

The writer keeps a batch and retries it after any failure (`kvguard.audit.writer`). A failure can
come after the database committed: the connection drops while the COMMIT's answer is on its way, and
the client sees an error for a transaction that stands. Retrying then appended every entry of the
batch a second time (found by a review: leaves n0..n4, n0..n4); the tree still verified, and
figures summed from the log (blocks cleared, purges) were inflated with nothing to flag them.

So each queued entry is prepared once (leaf bytes, leaf hash: a payload's commitment salt is random
and would differ if prepared again) and kept until it is durable, and each attempt records, inside
its transaction, the index its entries are inserted at. After a failed attempt the next one first
reads the log at exactly those indexes: if the failed batch is there (it committed as a whole or
not at all), it counts as appended, and only what was queued after it is appended.
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
        # Where a failed attempt's entries went, read inside its transaction (the head it locked)
        # and how many: if it committed after all, they are exactly there.
        self._attempt: tuple[int, int] | None = None

    def __call__(self, entries: Sequence[Entry]) -> None:
        prepared = [p for entry in entries for p in self._prepare(entry)]
        if self._attempt is not None:
            landed = self._landed(prepared, *self._attempt)
            if landed:
                _log.warning(
                    "ledger batch committed before its write failed; not appended again",
                    entries=landed,
                )
            prepared = prepared[landed:]
        at: list[int] = []
        try:
            if prepared:
                self._store.append(prepared, after=lambda _conn, first: at.append(first))
        except BaseException:
            # Before its inserts ran nothing can have committed: no position, nothing to look for.
            self._attempt = (at[0], len(prepared)) if at else None
            raise
        self._attempt = None
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

    def _landed(self, prepared: list[PreparedEntry], first: int, count: int) -> int:
        """How many of `prepared` (from the first) the failed attempt of `count` entries at index
        `first` committed: all of it or none (one transaction), found by position, never by a
        search (a repeat of identical leaf bytes elsewhere in the log is another entry)."""
        with self._store.engine.connect() as conn:
            stored = conn.execute(
                sa.select(t.LedgerEntry.leaf_hash)
                .where(t.LedgerEntry.idx >= first, t.LedgerEntry.idx < first + count)
                .order_by(t.LedgerEntry.idx)
            ).scalars()
            hashes = [bytes(h) for h in stored]
        ours = [p.leaf_hash for p in prepared[:count]]
        return count if hashes == ours and len(ours) == count else 0
