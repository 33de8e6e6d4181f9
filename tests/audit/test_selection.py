"""One predicate decides what a filtered export holds, for both exporters and the offline verifier
(`kvguard.audit.selection`): its semantics, and the three callers agreeing on the same entries."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from kvguard.audit import offline
from kvguard.audit.export import _selector
from kvguard.audit.selection import Selection, ts_micros
from kvguard.errors import VerificationError

T0 = datetime(2026, 11, 28, 12, 0, 0, tzinfo=UTC)


def _event(tag: str, kind: str, ts: datetime) -> dict[str, str]:
    return {"scope_tag": tag, "kind": kind, "ts": ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}


EVENTS = [
    _event(tag, kind, T0 + timedelta(microseconds=us))
    for tag in ("st_a", "st_b", "tt_a")
    for kind in ("block.allocate", "zeroize", "purge.create")
    for us in (-1, 0, 1, 999_999, 1_000_000, 1_000_001)
]


def test_semantics() -> None:
    t = ts_micros(T0)
    assert Selection.of().holds("x", "y", 0)
    assert not Selection.of(scope_tags=[]).holds("st_a", "zeroize", t)  # no tags: nothing
    assert Selection.of(kinds=[]).holds("st_a", "zeroize", t)  # no kinds: every kind
    window = Selection.of(since=T0, until=T0 + timedelta(seconds=1))
    assert window.holds("st_a", "k", t) and not window.holds("st_a", "k", t - 1)
    assert window.holds("st_a", "k", t + 999_999) and not window.holds("st_a", "k", t + 1_000_000)
    naive = Selection.of(since=T0.replace(tzinfo=None))  # a time naming no zone is UTC
    assert naive.low == t
    both = Selection.of(scope_tag="st_a", scope_tags=["st_a", "st_b"])
    assert both.holds("st_a", "k", t) and not both.holds("st_b", "k", t)
    assert not Selection.of(scope_tag="st_a", scope_tags=["st_b"]).holds("st_a", "k", t)


@pytest.mark.parametrize(
    "filters",
    [
        {"scope_tag": "st_a"},
        {"kinds": ["zeroize", "purge.create"]},
        {"kinds": []},
        {"since": T0, "until": T0 + timedelta(seconds=1)},
        {"scope_tag": "st_b", "kinds": ["zeroize"], "since": T0 + timedelta(microseconds=1)},
    ],
)
def test_the_cli_export_and_the_verifier_select_the_same_entries(filters: dict) -> None:
    by_export = _selector(filters)
    signed = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in filters.items()}
    by_verifier = offline._in_selection("filtered " + json.dumps(signed))
    assert by_verifier is not None
    exported = [
        e
        for e in EVENTS
        if by_export.holds(e["scope_tag"], e["kind"], ts_micros(datetime.fromisoformat(e["ts"])))
    ]
    assert exported == [e for e in EVENTS if by_verifier(e)]
    assert 0 < len(exported) < len(EVENTS) or filters == {"kinds": []}


def test_the_api_export_and_the_verifier_select_the_same_entries() -> None:
    chosen = Selection.of(scope_tags=["st_a", "tt_a"], kinds=["zeroize"], until=T0)
    by_verifier = offline._in_selection(
        "filtered "
        + json.dumps(
            {"scope_tags": ["st_a", "tt_a"], "kinds": ["zeroize"], "until": T0.isoformat()}
        )
    )
    assert by_verifier is not None
    picked = [
        e
        for e in EVENTS
        if chosen.holds(e["scope_tag"], e["kind"], ts_micros(datetime.fromisoformat(e["ts"])))
    ]
    assert picked == [e for e in EVENTS if by_verifier(e)] and len(picked) == 2


@pytest.mark.parametrize(
    "selection",
    [
        {"scope_tags": "st_a"},  # a string, not a list: was read as a substring test
        {"kinds": "zeroize"},
        {"scope_tag": ["st_a"]},
        {"since": "yesterday"},
        {"tenant": "a"},
    ],
)
def test_the_verifier_refuses_a_selection_it_cannot_read(selection: dict) -> None:
    with pytest.raises(VerificationError, match="selection this verifier cannot read"):
        offline._in_selection("filtered " + json.dumps(selection))


def test_an_unreadable_event_time_is_outside_a_selection() -> None:
    by_verifier = offline._in_selection('filtered {"kinds": ["zeroize"]}')
    assert by_verifier is not None
    assert not by_verifier({"scope_tag": "st_a", "kind": "zeroize", "ts": "not a time"})
    by_tag = offline._in_selection('filtered {"scope_tags": ["st_a"]}')
    assert by_tag is not None  # a list where a tag belongs cannot be looked up: not selected
    assert not by_tag({"scope_tag": ["st_a"], "kind": "zeroize", "ts": T0.isoformat()})
