"""Time marks: the smallest and largest `ts` of every complete chunk of 1,024 ledger entries, so that a
time-range query walks only the index intervals that can hold the range.

Why: entries carry their caller's timestamp and arrive in roughly, not exactly, time order, so no
index yields "entries with since <= ts < until, in index order". Through the `ts` index a page sorts
every entry of the range (56-75 ms for an 800,000-entry range of a 1,000,000-entry ledger on the
2-core benchmark VM); walking in index order from entry 0 reads everything before the range (90-135
ms). The marks turn the range into the few index intervals whose chunks overlap it; the query walks
them in order with the exact `ts` filter kept, and stops after `limit` rows (docs/benchmarks.md).

A complete chunk never changes (the database refuses updates and deletes of entries), so its marks
are read once per process and extended as the log grows; the incomplete last chunk (at most 1,023
entries) is read on every query. Marks only narrow where to look: the `ts` filter stays in the SQL,
so a wrong mark could cost time, never admit a wrong entry (and would hide one only if the `ts_us`
column itself were edited, which `Ledger.verify` detects).
"""

from __future__ import annotations

import threading
from array import array

import sqlalchemy as sa

from kvguard.errors import VerificationError

CHUNK_BITS = 10
_MERGE_GAP = 8  # chunks: overlapping chunks closer than this are walked as one interval
_NO_BOUND_LO = -(1 << 63)
_NO_BOUND_HI = (1 << 63) - 1

_CHUNK_MARKS = sa.text(
    "SELECT idx / :chunk, MIN(ts_us), MAX(ts_us) FROM ledger_entries "
    "WHERE idx >= :lo AND idx < :hi GROUP BY idx / :chunk ORDER BY 1"
)


class TimeMarks:
    """Cached per-chunk `ts` bounds of one ledger (thread-safe; one per process and ledger)."""

    def __init__(self) -> None:
        self._low: array[int] = array("q")
        self._high: array[int] = array("q")
        self._lock = threading.Lock()

    def intervals(
        self, conn: sa.Connection, size: int, since_us: int | None, until_us: int | None
    ) -> list[tuple[int, int]]:
        """Increasing, disjoint index intervals [a, b) below `size` outside of which no entry has
        `since_us <= ts_us < until_us` (None: unbounded)."""
        lo_us = _NO_BOUND_LO if since_us is None else since_us
        hi_us = _NO_BOUND_HI if until_us is None else until_us
        chunk = 1 << CHUNK_BITS
        complete = size >> CHUNK_BITS
        low, high = self._marks(conn, complete)
        out: list[tuple[int, int]] = []
        for c in range(complete):
            if high[c] >= lo_us and low[c] < hi_us:
                _add(out, c * chunk, (c + 1) * chunk)
        if size > complete * chunk:
            tail = _read(conn, complete * chunk, size)
            if tail and tail[0][2] >= lo_us and tail[0][1] < hi_us:
                _add(out, complete * chunk, size)
        return out

    def _marks(self, conn: sa.Connection, complete: int) -> tuple[array[int], array[int]]:
        with self._lock:
            known = len(self._low)
            if known < complete:
                rows = _read(conn, known << CHUNK_BITS, complete << CHUNK_BITS)
                if [r[0] for r in rows] != list(range(known, complete)):
                    raise VerificationError("ledger entries are missing below the head size")
                self._low.extend(r[1] for r in rows)
                self._high.extend(r[2] for r in rows)
            return self._low, self._high


def _read(conn: sa.Connection, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(chunk, min ts_us, max ts_us) of the entries [lo, hi), per chunk that has any."""
    found = conn.execute(_CHUNK_MARKS, {"chunk": 1 << CHUNK_BITS, "lo": lo, "hi": hi})
    return [(int(c), int(low), int(high)) for c, low, high in found]


def _add(out: list[tuple[int, int]], lo: int, hi: int) -> None:
    """Append [lo, hi), merged into the last interval when the gap is under `_MERGE_GAP` chunks."""
    if out and lo - out[-1][1] < _MERGE_GAP << CHUNK_BITS:
        out[-1] = (out[-1][0], hi)
    else:
        out.append((lo, hi))
