"""Auditor queries over the ledger: by tenant scope tag, kinds, time range, request id, block id,
with keyset pagination on the entry index (stable while the log grows)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from kvguard.audit import schema as t
from kvguard.audit.events import AuditEvent
from kvguard.audit.leaf import decode_leaf, ts_micros

MAX_PAGE = 10_000


@dataclass(frozen=True)
class LedgerRecord:
    """One ledger entry as read back: its index, event (with its payload unless erased), leaf."""

    index: int
    event: AuditEvent
    leaf: bytes
    payload_erased: bool


@dataclass(frozen=True)
class QueryPage:
    records: list[LedgerRecord]
    next_after: int | None  # pass as `after` for the next page; None when this was the last


def select_indices(
    *,
    scope_tag: str | None = None,
    kinds: Sequence[str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    request_id: str | None = None,
    block_id: int | None = None,
    after: int | None = None,
    below: int | None = None,
) -> sa.Select[Any]:
    """SELECT idx, leaf of the matching entries in index order (`since` inclusive, `until` not)."""
    e = t.entries.c
    stmt = sa.select(e.idx, e.leaf).order_by(e.idx)
    if scope_tag is not None:
        stmt = stmt.where(e.scope_tag == scope_tag)
    if kinds:
        stmt = stmt.where(e.kind.in_([str(k) for k in kinds]))
    if since is not None:
        stmt = stmt.where(e.ts_us >= ts_micros(since))
    if until is not None:
        stmt = stmt.where(e.ts_us < ts_micros(until))
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


def run_query(conn: sa.Connection, *, limit: int = 100, **filters: Any) -> QueryPage:
    """One page of matching records (see `select_indices` for the filters)."""
    if not 0 < limit <= MAX_PAGE:
        raise ValueError(f"limit must be in 1..{MAX_PAGE}")
    found = conn.execute(select_indices(**filters).limit(limit + 1)).all()
    more = len(found) > limit
    rows: list[tuple[int, bytes]] = [(int(r[0]), bytes(r[1])) for r in found[:limit]]
    payloads = _payloads(conn, [idx for idx, _ in rows])
    records = []
    for idx, leaf in rows:
        event, commitment = decode_leaf(bytes(leaf))
        body = payloads.get(int(idx))
        if body is not None:
            event = event.model_copy(update={"payload": json.loads(body)})
        erased = commitment is not None and body is None
        records.append(LedgerRecord(int(idx), event, bytes(leaf), erased))
    return QueryPage(records, records[-1].index if more else None)


def _payloads(conn: sa.Connection, indices: list[int]) -> dict[int, bytes]:
    if not indices:
        return {}
    p = t.payloads.c
    rows = conn.execute(sa.select(p.idx, p.body).where(p.idx.in_(indices)))
    return {int(i): bytes(b) for i, b in rows}
