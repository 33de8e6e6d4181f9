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
        # Where a failed attempt's entries went, read inside its transaction (the head it locked),
        # how many, and which queued entries they were: if it committed after all, they are
        # exactly there.
        self._attempt: tuple[int, int, list[Entry]] | None = None
        # Queued entries found durable after a failed attempt: never appended again, also when
        # the next attempt (with more entries queued behind them) fails too (found by a re-test:
        # answer lost, then a failed retry, then one that landed: n0, n0, n1).
        self._landed: dict[int, Entry] = {}

    def __call__(self, entries: Sequence[Entry]) -> None:
        if self._attempt is not None:
            first, count, tried = self._attempt
            if self._committed(tried, first, count):
                _log.warning(
                    "ledger batch committed before its write failed; not appended again",
                    entries=count,
                )
                self._landed.update((id(entry), entry) for entry in tried)
            self._attempt = None  # its outcome is known now
        todo = [e for e in entries if self._landed.get(id(e)) is not e]
        prepared = [p for entry in todo for p in self._prepare(entry)]
        at: list[int] = []
        try:
            if prepared:
                self._store.append(prepared, after=lambda _conn, first: at.append(first))
        except BaseException:
            # Before its inserts ran nothing can have committed: no position, nothing to look for.
            self._attempt = (at[0], len(prepared), todo) if at else None
            raise
        for entry in entries:  # durable now, and leaving the writer's queue
            self._prepared.pop(id(entry), None)
            self._landed.pop(id(entry), None)

    def _prepare(self, entry: Entry) -> list[PreparedEntry]:
        kept = self._prepared.get(id(entry))
        if kept is not None and kept[0] is entry:
            return kept[1]
        events = [entry] if isinstance(entry, AuditEvent) else entry.audit_events()
        prepared = [prepare_entry(event) for event in events]
        self._prepared[id(entry)] = (entry, prepared)  # the entry kept alive: its id stays its own
        return prepared

    def _committed(self, tried: list[Entry], first: int, count: int) -> bool:
        """Whether the failed attempt of `count` entries at index `first` (those of `tried`)
        committed: all of it or none (one transaction), found by position, never by a search (a
        repeat of identical leaf bytes elsewhere in the log is another entry)."""
        ours = [p.leaf_hash for entry in tried for p in self._prepare(entry)]
        with self._store.engine.connect() as conn:
            stored = conn.execute(
                sa.select(t.LedgerEntry.leaf_hash)
                .where(t.LedgerEntry.idx >= first, t.LedgerEntry.idx < first + count)
                .order_by(t.LedgerEntry.idx)
            ).scalars()
            hashes = [bytes(h) for h in stored]
        return len(ours) == count and hashes == ours
