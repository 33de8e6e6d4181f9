"""Ledger queries: several scope tags at once (a tenant's), the kind index, and time ranges walked
through the time marks, checked against a brute-force filter of every entry."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.audit.events import AuditEvent
from kvguard.audit.leaf import ts_micros
from kvguard.audit.ledger import Ledger
from kvguard.audit.query import select_indices
from kvguard.audit.timemarks import CHUNK_BITS
from kvguard.errors import VerificationError

from .conftest import T0, make_event

Opener = Callable[..., Ledger]


def _all(ledger: Ledger, **filters: object) -> list[int]:
    """Every matching index, page by page (pages of 7 exercise the cursor)."""
    page = ledger.query(limit=7, **filters)
    seen = [r.index for r in page.records]
    while page.next_after is not None:
        page = ledger.query(limit=7, after=page.next_after, **filters)
        seen += [r.index for r in page.records]
    return seen


def test_scope_tags_match_any_of_a_tenants_tags(db_url: str, open_ledger: Opener) -> None:
    ledger = open_ledger(db_url)
    ledger.append_many([make_event(i) for i in range(60)])  # tags st-tenant0..2 round robin
    both = _all(ledger, scope_tags=["st-tenant1", "st-tenant2"])
    assert both == [i for i in range(60) if i % 3 in (1, 2)]
    assert _all(ledger, scope_tags=["st-tenant2", "st-tenant2", "st-nobody"]) == list(
        range(2, 60, 3)
    )
    # combined with the other filters, and with the single-tag filter (both must hold)
    assert _all(ledger, scope_tags=["st-tenant1"], kinds=["block.reuse"]) == [
        i for i in range(60) if i % 3 == 1 and i % 4 == 1
    ]
    assert _all(ledger, scope_tags=["st-tenant1"], scope_tag="st-tenant2") == []


def test_empty_scope_tags_match_nothing_not_everything(db_url: str, open_ledger: Opener) -> None:
    ledger = open_ledger(db_url)
    ledger.append_many([make_event(i) for i in range(10)])
    assert ledger.query(scope_tags=[]).records == []
    assert len(ledger.query(scope_tags=None).records) == 10


def test_kind_pages_use_the_kind_index(sqlite_url: str, open_ledger: Opener) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append(make_event(0))
    stmt = select_indices(kinds=["policy.change"], after=5).limit(101)
    sql = str(
        stmt.compile(dialect=ledger.store.engine.dialect, compile_kwargs={"literal_binds": True})
    )
    with ledger.store.engine.connect() as conn:
        plan = " ".join(str(r[3]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
    assert "ledger_entries_kind_idx" in plan and "TEMP B-TREE" not in plan


def _shuffled_log(n: int, seed: int) -> list[AuditEvent]:
    """Entries in roughly time order, with some far out of order (late or early submissions)."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
        ms = i + rng.randrange(30)
        if rng.random() < 0.01:
            ms = rng.randrange(n)  # a straggler anywhere in time
        events.append(make_event(i, ts=T0 + timedelta(milliseconds=ms)))
    return events


@pytest.fixture
def timed_ledger(sqlite_url: str, open_ledger: Opener) -> tuple[Ledger, list[AuditEvent]]:
    ledger = open_ledger(sqlite_url)
    events = _shuffled_log(3 * (1 << CHUNK_BITS) + 357, seed=5)  # 3 complete chunks and a tail
    ledger.append_many(events)
    return ledger, events


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    since=st.one_of(st.none(), st.integers(-5, 3500)),
    width=st.one_of(st.none(), st.integers(0, 4000)),
    after=st.one_of(st.none(), st.integers(-1, 3500)),
    limit=st.sampled_from([1, 5, 100, 1000]),
    kind=st.sampled_from([None, "block.zeroize"]),
)
def test_time_ranges_match_a_brute_force_filter(
    timed_ledger: tuple[Ledger, list[AuditEvent]],
    since: int | None,
    width: int | None,
    after: int | None,
    limit: int,
    kind: str | None,
) -> None:
    ledger, events = timed_ledger
    lo = T0 + timedelta(milliseconds=since) if since is not None else None
    hi = T0 + timedelta(milliseconds=(since or 0) + width) if width is not None else None
    expected = [
        i
        for i, e in enumerate(events)
        if (lo is None or ts_micros(e.ts) >= ts_micros(lo))
        and (hi is None or ts_micros(e.ts) < ts_micros(hi))
        and (after is None or i > after)
        and (kind is None or e.kind == kind)
    ]
    page = ledger.query(
        since=lo, until=hi, after=after, limit=limit, kinds=[kind] if kind else None
    )
    assert [r.index for r in page.records] == expected[:limit]
    assert page.next_after == (expected[limit - 1] if len(expected) > limit else None)


def test_time_marks_follow_the_growing_log(sqlite_url: str, open_ledger: Opener) -> None:
    ledger = open_ledger(sqlite_url)
    chunk = 1 << CHUNK_BITS
    ledger.append_many([make_event(i, ts=T0 + timedelta(seconds=i)) for i in range(chunk + 5)])
    window: dict[str, Any] = {
        "since": T0 + timedelta(seconds=3),
        "until": T0 + timedelta(seconds=4),
    }
    assert [r.index for r in ledger.query(**window).records] == [3]
    # A late submission with an old timestamp lands in a later chunk, after the marks were read.
    ledger.append_many([make_event(i, ts=T0 + timedelta(seconds=3.5)) for i in range(2 * chunk)])
    found = _all(ledger, **window)
    assert found == [3, *range(chunk + 5, 3 * chunk + 5)]


def test_time_marks_refuse_a_log_with_missing_entries(sqlite_url: str, open_ledger: Opener) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range((1 << CHUNK_BITS) + 1)])
    with ledger.store.engine.begin() as conn:  # an attacker with the file drops a trigger and a row
        conn.exec_driver_sql("DROP TRIGGER ledger_entries_no_delete")
        conn.execute(sa.text("DELETE FROM ledger_entries WHERE idx < 1024"))
    with pytest.raises(VerificationError):
        ledger.query(since=T0)


def test_an_unknown_filter_is_refused_not_ignored(sqlite_url: str, open_ledger: Opener) -> None:
    """Pages run statements built once per combination of filters: a misspelt filter must fail
    loudly, as a keyword argument of `select_indices` does, not match every entry."""
    ledger = open_ledger(sqlite_url)
    ledger.append(make_event(0))
    with pytest.raises(TypeError, match="scope_tagz"):
        ledger.query(scope_tagz="st_x")
    assert [r.index for r in ledger.query(scope_tag="st_nobody").records] == []
