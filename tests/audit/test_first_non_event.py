"""`bundle.first_non_event` (the offline `--full` path's check that every leaf a line carries as an
event is one) must decide exactly as `bundle.is_event` leaf by leaf: it matches a whole block of
leaves at once and checks each distinct date once, so the leaves that could slip through such a
shortcut are tried here: a leaf holding a newline (two events in one leaf), times and dates that
the pattern's digits admit but no calendar does, bytes that are not UTF-8, an exponent that
overflows, and every hostile text of the foreign-leaf tests."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from kvguard.audit import bundle
from kvguard.audit.leaf import prepare_entry

from .conftest import make_event
from .test_foreign_leaf_attacks import (
    _CRAFTED,
    _INF,
    _INF_SIGNED,
    _ODD,
    _ODD_FOREIGN,
    _SURROGATE,
    _leaf,
)


def _events(n: int) -> list[bytes]:
    return [prepare_entry(make_event(i)).leaf for i in range(n)]


_GOOD = _events(8)
_HOSTILE = {
    "two events in one leaf": _GOOD[0] + b"\n" + _GOOD[1],
    "trailing newline": _GOOD[0] + b"\n",
    "hour 24": _leaf(ts=b"2026-11-26T24:00:00.000000"),
    "minute 60": _leaf(ts=b"2026-11-26T12:60:00.000000"),
    "second 60": _leaf(ts=b"2026-11-26T12:00:60.000000"),
    "february 30": _leaf(ts=b"2026-02-30T12:00:00.000000"),
    "february 29, not a leap year": _leaf(ts=b"2025-02-29T12:00:00.000000"),
    "month 13": _leaf(ts=b"2026-13-01T12:00:00.000000"),
    "day 00": _leaf(ts=b"2026-11-00T12:00:00.000000"),
    "year 0000": _leaf(ts=b"0000-01-01T00:00:00.000000"),
    "not utf-8": _leaf(details=b'{"a":"\xff\xfe"}'),
    "half a utf-8 character": _leaf(details=b'{"a":"\xc3"}'),
    "infinity": _INF,
    "signed infinity": _INF_SIGNED,
    "lone surrogate": _SURROGATE,
    "empty": b"",
    "null": b"null",
    "one space": _GOOD[2].replace(b',"kind"', b', "kind"'),
    **{f"odd foreign {k}": v[0] for k, v in _ODD_FOREIGN.items()},
}
_VALID = {
    "february 29, a leap year": _leaf(ts=b"2024-02-29T23:59:59.999999"),
    "midnight": _leaf(ts=b"2026-01-01T00:00:00.000000"),
    "year 9999": _leaf(ts=b"9999-12-31T23:59:59.999999"),
    "large finite exponent": _leaf(details=b'{"x":1.7e+307}'),
    "finite exponent of 308": _leaf(details=b'{"x":1.7e+308}'),
    **{f"odd {k}": v[0] for k, v in _ODD.items()},
}


def _reference(leaves: list[bytes]) -> int | None:
    return next((j for j, leaf in enumerate(leaves) if not bundle.is_event(leaf)), None)


def test_the_cases_are_what_they_claim() -> None:
    assert all(not bundle.is_event(leaf) for leaf in _HOSTILE.values())
    assert all(bundle.is_event(leaf) for leaf in [*_GOOD, *_VALID.values()])


@pytest.mark.parametrize("name", list(_HOSTILE))
def test_a_non_event_is_found_wherever_it_sits(name: str) -> None:
    for at in (0, 3, 8):
        leaves = [*_GOOD[:at], _HOSTILE[name], *_GOOD[at:]]
        assert bundle.first_non_event(leaves) == at


@pytest.mark.parametrize("name", list(_VALID))
def test_an_event_of_an_unusual_shape_is_an_event(name: str) -> None:
    assert bundle.first_non_event([*_GOOD, _VALID[name], *_GOOD]) is None


def test_random_blocks_agree_with_is_event_leaf_by_leaf() -> None:
    rng = random.Random(16)
    pool = [*_GOOD, *_VALID.values(), *_HOSTILE.values()]
    t0 = datetime(2024, 2, 27, 23, 59, 59, tzinfo=UTC)
    days = [prepare_entry(make_event(i, ts=t0 + timedelta(hours=7 * i))).leaf for i in range(40)]
    for _ in range(2_000):
        leaves = rng.choices([*pool, *days], k=rng.randint(0, 12))
        if rng.random() < 0.3 and leaves:  # a random byte of a random leaf changed
            j = rng.randrange(len(leaves))
            if leaves[j]:
                k = rng.randrange(len(leaves[j]))
                leaves[j] = leaves[j][:k] + bytes([rng.randrange(256)]) + leaves[j][k + 1 :]
        assert bundle.first_non_event(leaves) == _reference(leaves), leaves


def test_an_empty_block_has_no_non_event() -> None:
    assert bundle.first_non_event([]) is None


@pytest.mark.parametrize("name", ["long-string-failing-at-v", "many-pairs-failing-at-v"])
def test_crafted_megabyte_leaves_are_decided_quickly(name: str) -> None:
    assert bundle.first_non_event([*_GOOD, _CRAFTED[name]]) == len(_GOOD)
