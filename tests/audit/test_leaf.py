"""Leaf bytes: canonical, versioned, round-trippable; payload commitments are salted."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.audit import leaf as lf
from kvguard.audit import payloads
from kvguard.errors import VerificationError

from .conftest import make_event

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
_names = st.sampled_from(["blocks", "bytes", "layer", "note", "reason", "policy_version", "ok"])


def test_leaf_is_canonical_json_with_sorted_keys_and_no_whitespace() -> None:
    event = make_event(3)
    leaf = lf.encode_leaf(event, None)
    obj = json.loads(leaf)
    assert list(obj) == sorted(obj)
    assert leaf == json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    assert obj["v"] == 1 and obj["ts"] == "2026-11-26T12:00:00.003000Z"
    assert b", " not in leaf and b": " not in leaf


@given(st.dictionaries(_names, _scalars, max_size=5), st.lists(st.integers(0, 10**9), max_size=8))
def test_leaf_round_trips(details: dict[str, object], block_ids: list[int]) -> None:
    event = make_event(0, details=details, block_ids=block_ids)
    leaf = lf.encode_leaf(event, None)
    decoded, commitment = lf.decode_leaf(leaf)
    assert commitment is None
    assert lf.encode_leaf(decoded, None) == leaf


_text = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20)


@given(
    st.dictionaries(_names, _scalars, max_size=5),
    st.lists(st.integers(0, 2**40), max_size=8),
    st.none() | _text,
    st.none() | _text,
    st.none() | st.binary(min_size=32, max_size=32),
)
def test_fast_leaf_renderer_equals_the_canonical_definition(
    details: dict[str, object],
    block_ids: list[int],
    scope_tag: str | None,
    request_id: str | None,
    commitment: bytes | None,
) -> None:
    event = make_event(
        0, details=details, block_ids=block_ids, scope_tag=scope_tag, request_id=request_id
    )
    assert lf.render_leaf(event, commitment) == lf.canonical_json(lf.leaf_object(event, commitment))


@given(
    st.datetimes(
        min_value=datetime(1, 1, 2),  # naive bounds; hypothesis adds the zone
        max_value=datetime(9999, 12, 30),
        timezones=st.timezones(),
    )
)
def test_cached_timestamp_text_is_the_one_spelling_per_instant(ts: datetime) -> None:
    text = lf.format_ts(ts)
    # the definition before the per-second cache (`isoformat` zero-pads years; strftime may not)
    assert text == ts.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"
    assert lf.parse_ts(text) == ts.astimezone(UTC)


def test_non_canonical_leaf_bytes_are_refused() -> None:
    leaf = lf.encode_leaf(make_event(0), None)
    spaced = json.dumps(json.loads(leaf), sort_keys=True).encode()
    with pytest.raises(VerificationError, match="canonical"):
        lf.decode_leaf(spaced)
    with pytest.raises(VerificationError):
        lf.decode_leaf(leaf.replace(b'"v":1', b'"v":2'))


def test_payload_stays_out_of_the_leaf_and_commitment_is_salted() -> None:
    event = make_event(0, payload={"user": "alice@example.com"})
    a, b = lf.prepare_entry(event), lf.prepare_entry(event)
    assert b"alice" not in a.leaf
    assert a.payload is not None and b.payload is not None
    assert a.payload[0] != b.payload[0]  # fresh salt each time
    assert a.leaf != b.leaf  # so equal payloads do not even show as equal commitments
    commitment = bytes.fromhex(json.loads(a.leaf)["payload_commitment"])
    payloads.check_commitment(commitment, a.payload[0], a.payload[1])
    with pytest.raises(VerificationError):
        payloads.check_commitment(commitment, b.payload[0], a.payload[1])
    with pytest.raises(VerificationError):
        payloads.check_commitment(commitment, a.payload[0], a.payload[1].replace(b"alice", b"bob"))


def test_commitment_must_match_payload_presence() -> None:
    with pytest.raises(ValueError):
        lf.encode_leaf(make_event(0), b"\x00" * 32)
    with pytest.raises(ValueError):
        lf.encode_leaf(make_event(0, payload={"user": "x"}), None)
