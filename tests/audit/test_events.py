"""G6: the event schema refuses anything that reads like token ids, prompts, salts or key material."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvguard.audit.events import AuditEvent, DetailValue, EventKind, _check_field, _check_mapping
from kvguard.errors import SensitiveFieldError

from .conftest import T0, make_event


@pytest.mark.parametrize(
    "field",
    [
        "prompt",
        "prompt_text",
        "token_ids",
        "tokens",
        "cache_salt",
        "salt",
        "api_key",
        "secret",
        "signing_key",
        "private_key",
        "password",
        "completion",
        "messages",
        "content",
        "seed",
        "promptTokenIds",
        "hmac_key",
    ],
)
@pytest.mark.parametrize("where", ["details", "payload"])
def test_G6_sensitive_field_names_are_refused(field: str, where: str) -> None:
    with pytest.raises(SensitiveFieldError) as info:
        make_event(0, **{where: {field: "x"}})
    assert field in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        "1, 2, 3, 4, 5, 6, 7, 8, 9",
        "[101, 2023, 2003, 1037, 7953, 1997, 2115, 3231]",
        "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEI\n-----END PRIVATE KEY-----",
        "Please summarise the following confidential contract. " * 5,
    ],
)
def test_G6_sensitive_values_are_refused_without_echoing_them(value: str) -> None:
    with pytest.raises(SensitiveFieldError) as info:
        make_event(0, details={"note": value})
    assert value not in str(info.value)
    assert "details.note" in str(info.value)


@pytest.mark.parametrize(
    "details",
    [
        {"num_tokens": 96},
        {"tokens_matched": 32},
        {"blocks": 3, "bytes": 65536},
        {"key_id": "k2"},
        {"policy_version": 7, "ok": True, "ratio": 0.5, "none": None},
    ],
)
def test_counts_and_public_identifiers_are_allowed(details: dict[str, object]) -> None:
    assert make_event(0, details=details).details == details


def test_event_kinds_cover_the_issue() -> None:
    wanted = {
        "block.alloc",
        "block.reuse",
        "block.release",
        "block.evict",
        "block.zeroize",
        "session.purge",
        "tenant.purge",
        "policy.change",
        "admin.action",
        "key.rotate",
    }
    assert wanted <= {k.value for k in EventKind}
    with pytest.raises(ValidationError):
        make_event(0, kind="block.teleport")


def test_timestamps_must_be_aware_and_are_normalised_to_utc() -> None:
    with pytest.raises(ValidationError, match="timezone-aware"):
        make_event(0, ts=datetime(2026, 11, 26, 12, 0))
    plus2 = timezone(timedelta(hours=2))
    event = make_event(0, ts=datetime(2026, 11, 26, 14, 0, tzinfo=plus2))
    assert event.ts == T0 and event.ts.utcoffset() == timedelta(0)


def test_events_are_frozen_and_versioned() -> None:
    event = make_event(1)
    assert event.v == 1
    with pytest.raises(ValidationError):
        event.kind = "block.evict"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        AuditEvent.model_validate({**event.model_dump(), "v": 2})
    with pytest.raises(ValidationError):
        AuditEvent.model_validate({**event.model_dump(), "extra_field": 1})


def test_negative_block_ids_and_nan_are_refused() -> None:
    with pytest.raises(ValidationError):
        make_event(0, block_ids=[-1])
    with pytest.raises(ValidationError):
        make_event(0, details={"ratio": float("nan")})


# --- the cached verdicts for plain values agree with the full field check ------------------------

_NAMES = st.sampled_from(
    [
        "blocks",
        "tokens_matched",
        "reason",
        "handover",
        "bytes_cleared",
        "salt",
        "prompt",
        "n",
        "seed",
    ]
)
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["x" * 201, "-----BEGIN PRIVATE KEY-----", "1, 2, 3, 4, 5, 6, 7, 8, 9", "ok"]),
)


def _outcome(check, *args):  # type: ignore[no-untyped-def]
    try:
        check(*args)
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    return None


@settings(max_examples=500, deadline=None)
@given(details=st.dictionaries(_NAMES, _VALUES, max_size=4))
def test_G6_cached_verdicts_refuse_exactly_what_the_field_check_refuses(
    details: dict[str, DetailValue],
) -> None:
    def one_by_one(mapping: dict[str, DetailValue]) -> None:
        for name, value in mapping.items():
            _check_field("details", name, value)

    assert _outcome(_check_mapping, "details", details) == _outcome(one_by_one, details)
