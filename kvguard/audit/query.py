"""Auditor queries over the ledger: by scope tag (one, or any of a tenant's several), kinds, time
range, request id, block id, with keyset pagination on the entry index (stable while the log grows).

Every filter is served by an index that ends in `idx` (`ledger_entries_scope_idx`,
`ledger_entries_kind_idx`, the block links' primary key; on SQLite every secondary index ends in the
rowid, which is `idx`), so a page is a short index range walk in `idx` order, not a sort of every
match."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import sqlalchemy as sa

from kvguard.audit import bundle
from kvguard.audit import schema as t
from kvguard.audit.events import AuditEvent, DetailValue
from kvguard.audit.leaf import decode_leaf, ts_micros
from kvguard.audit.store import CheckpointRow
from kvguard.audit.timemarks import TimeMarks
from kvguard.errors import VerificationError

MAX_PAGE = 10_000


@dataclass(frozen=True)
class LedgerRecord:
    """One ledger entry as read back: its index, leaf bytes and erasable payload (None when it
    has none or it was erased).

    `event` decodes the leaf through the event model, with every check of `decode_leaf`, on first
    use. Listing pages read `leaf` as JSON instead: the model's checks cost 50-60 us per entry on
    the benchmark VM, most of a 100-entry page (profiled), for leaves the ledger validated when it
    appended them and that proofs authenticate.
    """

    index: int
    leaf: bytes
    payload: dict[str, DetailValue] | None
    payload_erased: bool

    @cached_property
    def event(self) -> AuditEvent:
        event, _ = decode_leaf(self.leaf)
        if self.payload is not None:
            event = event.model_copy(update={"payload": self.payload})
        return event


@dataclass(frozen=True)
class QueryPage:
    records: list[LedgerRecord]
    next_after: int | None  # pass as `after` for the next page; None when this was the last


def select_indices(
    *,
    scope_tag: str | None = None,
    scope_tags: Sequence[str] | None = None,
    kinds: Sequence[str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    request_id: str | None = None,
    block_id: int | None = None,
    after: int | None = None,
    below: int | None = None,
    ts_index: bool = True,
) -> sa.Select[Any]:
    """SELECT idx, leaf of the matching entries in index order (`since` inclusive, `until` not).

    `scope_tags`: entries carrying any of these tags (a tenant's `st_` tags and its `tt_` tag). An
    empty sequence matches nothing: a tenant without tags has no entries, never everybody's.
    `ts_index=False` keeps the planner off the `ts` index (the caller bounds the walk by index
    intervals instead, see `kvguard.audit.timemarks`).
    """
    e = t.entries.c
    stmt = sa.select(e.idx, e.leaf).order_by(e.idx)
    if scope_tag is not None:
        stmt = stmt.where(e.scope_tag == scope_tag)
    if scope_tags is not None:
        stmt = stmt.where(e.scope_tag.in_(sorted(set(scope_tags))))
    if kinds:
        stmt = stmt.where(e.kind.in_([str(k) for k in kinds]))
    # `ts_us + 0` is not an indexed column to either planner: the walk stays in `idx` order.
    ts = e.ts_us if ts_index else e.ts_us + 0
    if since is not None:
        stmt = stmt.where(ts >= ts_micros(since))
    if until is not None:
        stmt = stmt.where(ts < ts_micros(until))
    if request_id is not None:
        stmt = stmt.where(e.request_id == request_id)
    if block_id is not None:
        links = sa.select(t.entry_blocks.c.idx).where(t.entry_blocks.c.block_id == block_id)
        stmt = stmt.where(e.idx.in_(links))
    if after is not None:
        stmt = stmt.where(e.idx > after)
    if below is not None:
        stmt = stmt.where(e.idx < below)
    return stmt


def run_query(
    conn: sa.Connection, *, limit: int = 100, marks: TimeMarks | None = None, **filters: Any
) -> QueryPage:
    """One page of matching records (see `select_indices` for the filters). With `marks`, a time
    range is walked only through the index intervals that can hold it."""
    if not 0 < limit <= MAX_PAGE:
        raise ValueError(f"limit must be in 1..{MAX_PAGE}")
    timed = filters.get("since") is not None or filters.get("until") is not None
    if marks is not None and timed:
        found = _walk_intervals(conn, marks, limit + 1, filters)
    else:
        found = [(r[0], r[1]) for r in conn.execute(select_indices(**filters).limit(limit + 1))]
    more = len(found) > limit
    rows: list[tuple[int, bytes]] = [(int(r[0]), bytes(r[1])) for r in found[:limit]]
    payloads = _payloads(conn, [idx for idx, _ in rows])
    records = []
    for idx, leaf in rows:
        if not bundle.is_event(leaf):
            # A foreign leaf (written outside kvguard, docs/audit.md): no event to show. Paging
            # goes on past it: `next_after` is the last row read, shown or not.
            continue
        body = payloads.get(idx)
        erased = body is None and _has_commitment(leaf)
        payload = json.loads(body) if body is not None else None
        records.append(LedgerRecord(idx, leaf, payload, erased))
    return QueryPage(records, rows[-1][0] if more else None)


def _has_commitment(leaf: bytes) -> bool:
    """Whether a canonical leaf commits to a payload. Its top-level `payload_commitment` follows
    `details` (sorted keys) and a bare `,"` occurs only between fields, so the last match is it."""
    at = leaf.rfind(b',"payload_commitment":')
    return at >= 0 and not leaf.startswith(b"null", at + len(b',"payload_commitment":'))


def checkpoint_page(
    conn: sa.Connection, *, after: int | None = None, limit: int = 100
) -> tuple[list[CheckpointRow], int | None]:
    """Stored checkpoints by increasing tree size after `after`, and the `after` of the next page."""
    if not 0 < limit <= MAX_PAGE:
        raise ValueError(f"limit must be in 1..{MAX_PAGE}")
    stmt = _checkpoints().limit(limit + 1)
    if after is not None:
        stmt = stmt.where(t.checkpoints.c.size > after)
    rows = [_checkpoint(r) for r in conn.execute(stmt)]
    return rows[:limit], rows[limit - 1].size if len(rows) > limit else None


def checkpoint_at(conn: sa.Connection, size: int) -> CheckpointRow | None:
    """The checkpoint stored for tree size `size`, if one was signed at that size."""
    row = conn.execute(_checkpoints().where(t.checkpoints.c.size == size)).first()
    return _checkpoint(row) if row is not None else None


def _checkpoints() -> sa.Select[Any]:
    c = t.checkpoints.c
    return sa.select(c.size, c.root, c.note, c.prev_size).order_by(c.size)


def _checkpoint(row: sa.Row[Any]) -> CheckpointRow:
    size, root, text, prev = tuple(row)
    return CheckpointRow(int(size), bytes(root), str(text), None if prev is None else int(prev))


def _walk_intervals(
    conn: sa.Connection, marks: TimeMarks, want: int, filters: dict[str, Any]
) -> list[tuple[int, bytes]]:
    """Up to `want` matching rows, interval by interval in index order (each a bounded walk)."""
    since, until = filters.get("since"), filters.get("until")
    size = _head_size(conn)
    spans = marks.intervals(
        conn,
        size,
        ts_micros(since) if since is not None else None,
        ts_micros(until) if until is not None else None,
    )
    after, below = filters.get("after"), filters.get("below")
    rest = {k: v for k, v in filters.items() if k not in ("after", "below")}
    found: list[tuple[int, bytes]] = []
    for lo, hi in spans:
        start = lo - 1 if after is None else max(lo - 1, after)
        stop = hi if below is None else min(hi, below)
        if start + 1 >= stop:
            continue
        stmt = select_indices(**rest, after=start, below=stop, ts_index=False)
        found += [(r[0], r[1]) for r in conn.execute(stmt.limit(want - len(found)))]
        if len(found) >= want:
            break
    return found


def _head_size(conn: sa.Connection) -> int:
    size = conn.execute(sa.select(t.head.c.size).where(t.head.c.id == 1)).scalar_one_or_none()
    if size is None:
        raise VerificationError("the ledger head row is missing: the log was tampered with")
    return int(size)


def _payloads(conn: sa.Connection, indices: list[int]) -> dict[int, bytes]:
    if not indices:
        return {}
    p = t.payloads.c
    rows = conn.execute(sa.select(p.idx, p.body).where(p.idx.in_(indices)))
    return {int(i): bytes(b) for i, b in rows}
