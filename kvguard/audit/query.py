"""Auditor queries over the ledger: by scope tag (one, or any of a tenant's several), kinds, time
range, request id, block id, with keyset pagination on the entry index (stable while the log grows).

Every filter is served by an index that ends in `idx` (`ledger_entries_scope_idx`,
`ledger_entries_kind_idx`, the block links' primary key; on SQLite every secondary index ends in the
rowid, which is `idx`), so a page is a short index range walk in `idx` order, not a sort of every
match."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any, Final

import sqlalchemy as sa

from kvguard.audit import bundle
from kvguard.audit import schema as t
from kvguard.audit.events import AuditEvent, DetailValue
from kvguard.audit.leaf import decode_leaf
from kvguard.audit.request_ids import recorded_forms
from kvguard.audit.selection import ts_micros
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
    shape, values = _filter_values(
        scope_tag=scope_tag,
        scope_tags=scope_tags,
        kinds=kinds,
        since=since,
        until=until,
        request_id=request_id,
        block_id=block_id,
        after=after,
        below=below,
    )
    return _indices_query(shape, ts_index, limited=False).params(values)


_FILTERS = (
    "scope_tag", "scope_tags", "kinds", "since", "until", "request_id", "block_id", "after", "below"
)  # fmt: skip


def _filter_values(
    *,
    scope_tag: str | None,
    scope_tags: Sequence[str] | None,
    kinds: Sequence[str] | None,
    since: datetime | None,
    until: datetime | None,
    request_id: str | None,
    block_id: int | None,
    after: int | None,
    below: int | None,
) -> tuple[tuple[bool, ...], dict[str, Any]]:
    """Which filters are given (the statement's shape) and their bind parameters' values."""
    given = {
        "scope_tag": scope_tag,
        "scope_tags": None if scope_tags is None else sorted(set(scope_tags)),
        "kinds": [str(k) for k in kinds] if kinds else None,
        "since": None if since is None else ts_micros(since),
        "until": None if until is None else ts_micros(until),
        "request_id": None if request_id is None else recorded_forms(request_id),
        "block_id": block_id,
        "after": after,
        "below": below,
    }
    values = {name: value for name, value in given.items() if value is not None}
    return tuple(name in values for name in _FILTERS), values


@functools.cache
def _indices_query(shape: tuple[bool, ...], ts_index: bool, *, limited: bool) -> sa.Select[Any]:
    """`select_indices`'s statement for one combination of filters, built once with a bind
    parameter per filter (and `limit` when `limited`): building a statement and its cache key
    cost about as much CPU as running it (docs/benchmarks.md, 2026-11-28)."""
    e = t.entries.c
    has = dict(zip(_FILTERS, shape, strict=True))
    stmt = sa.select(e.idx, e.leaf).order_by(e.idx)
    if has["scope_tag"]:
        stmt = stmt.where(e.scope_tag == sa.bindparam("scope_tag", type_=sa.String))
    if has["scope_tags"]:
        stmt = stmt.where(e.scope_tag.in_(sa.bindparam("scope_tags", expanding=True)))
    if has["kinds"]:
        stmt = stmt.where(e.kind.in_(sa.bindparam("kinds", expanding=True)))
    # `ts_us + 0` is not an indexed column to either planner: the walk stays in `idx` order.
    ts = e.ts_us if ts_index else e.ts_us + 0
    if has["since"]:
        stmt = stmt.where(ts >= sa.bindparam("since", type_=sa.BigInteger))
    if has["until"]:
        stmt = stmt.where(ts < sa.bindparam("until", type_=sa.BigInteger))
    if has["request_id"]:
        # The id as given and in its recorded form (`kvguard.audit.request_ids`).
        stmt = stmt.where(e.request_id.in_(sa.bindparam("request_id", expanding=True)))
    if has["block_id"]:
        blocks = t.entry_blocks.c
        links = sa.select(blocks.idx).where(
            blocks.block_id == sa.bindparam("block_id", type_=sa.BigInteger)
        )
        stmt = stmt.where(e.idx.in_(links))
    if has["after"]:
        stmt = stmt.where(e.idx > sa.bindparam("after", type_=sa.BigInteger))
    if has["below"]:
        stmt = stmt.where(e.idx < sa.bindparam("below", type_=sa.BigInteger))
    if limited:
        stmt = stmt.limit(sa.bindparam("limit", type_=sa.Integer))
    return stmt


def _page_rows(
    conn: sa.Connection, limit: int, filters: dict[str, Any], *, ts_index: bool = True
) -> list[tuple[int, bytes]]:
    """Up to `limit` rows of `select_indices(**filters)`, through the statement built once."""
    if unknown := set(filters).difference(_FILTERS):
        raise TypeError(f"unknown ledger query filters: {sorted(unknown)}")
    shape, values = _filter_values(**{name: filters.get(name) for name in _FILTERS})
    stmt = _indices_query(shape, ts_index, limited=True)
    return [(r[0], r[1]) for r in conn.execute(stmt, {**values, "limit": limit})]


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
        found = _page_rows(conn, limit + 1, filters)
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
        window = {**rest, "after": start, "below": stop}
        found += _page_rows(conn, want - len(found), window, ts_index=False)
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
    rows = conn.execute(_PAYLOADS, {"indices": indices})
    return {int(i): bytes(b) for i, b in rows}


_PAYLOADS: Final = sa.select(t.payloads.c.idx, t.payloads.c.body).where(
    t.payloads.c.idx.in_(sa.bindparam("indices", expanding=True))
)
