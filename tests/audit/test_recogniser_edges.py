"""Edges of `bundle.is_event` (the genuine / foreign recogniser) found by review; each test fails
on the code it was written against.

- `18e+307`: `_NUM` admits up to 17 integer digits before an exponent, `_BIG_EXPONENT` only looks
  at exponents from 308, so a mantissa above 1.79 with `e+307` (or `17.98e+307`, ...) parses to
  infinity yet reads as an event: OCSF / CSV hold `Infinity` and the verifier names no foreign
  entry (the `1.8e+308` case of test_foreign_leaf_attacks, by another spelling).
- `T24:00:00.000000`: `is_event` checks the time with `datetime.fromisoformat`, which accepts hour
  24 from CPython 3.14 on (gh-102450); `ocsf_line` (strptime) and a 3.11 verifier refuse it.
- a lone surrogate: the event model accepts it, the leaf encoder cannot write it (UnicodeEncodeError),
  so the background writer retries the batch forever.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvguard.audit import bundle
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey

from .conftest import make_event
from .test_foreign_leaf_attacks import _leaf, _log_with, _verify

Opener = Callable[..., Ledger]

_OVERFLOWING = [b"18e+307", b"-18e+307", b"99999999999999999e+307", b"17.98e+307", b"2e+308"]


@pytest.mark.parametrize("number", _OVERFLOWING, ids=[n.decode() for n in _OVERFLOWING])
def test_a_number_that_overflows_below_exponent_308_is_foreign(number: bytes) -> None:
    leaf = _leaf(details=b'{"x":' + number + b"}")
    assert json.loads(leaf)["details"]["x"] in (float("inf"), float("-inf"))
    assert not bundle.is_event(leaf)
    assert bundle.first_non_event([leaf]) == 0


def test_an_overflowing_detail_is_never_rendered(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    index = _log_with(ledger, _leaf(details=b'{"x":18e+307}'))
    ledger.export(tmp_path / "b")
    assert _verify(tmp_path / "b", key).foreign == (index,)

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    for line in (tmp_path / "b" / bundle.OCSF).read_text(encoding="utf-8").splitlines():
        json.loads(line, parse_constant=refuse)


class _Datetime314(dt.datetime):
    """`datetime.fromisoformat` as CPython 3.14 has it: `T24:00[:00[.000000]]` is next midnight."""

    @classmethod
    def fromisoformat(cls, text: str) -> dt.datetime:  # type: ignore[override]
        day, _, time = text.partition("T")
        if time in ("24:00", "24:00:00", "24:00:00.000000"):
            return dt.datetime.fromisoformat(day) + dt.timedelta(days=1)
        return dt.datetime.fromisoformat(text)


def test_hour_24_is_foreign_in_every_python(monkeypatch: pytest.MonkeyPatch) -> None:
    leaf = _leaf(ts=b"2026-11-26T24:00:00.000000")
    assert not bundle.is_event(leaf)  # 3.11-3.13
    monkeypatch.setattr(bundle, "datetime", _Datetime314)
    assert not bundle.is_event(leaf)  # 3.14+: fromisoformat accepts it, ocsf_line does not


def test_the_event_model_refuses_what_the_leaf_encoder_cannot_write() -> None:
    for details in ({"note": "a\ud800"}, {"no\udc00te": 1}):
        with pytest.raises(ValueError):
            make_event(1, details=details)
