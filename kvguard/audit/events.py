"""The audit event schema (version 1): what an engine, the policy layer or the admin API records.

An `AuditEvent` is validated on construction so that nothing sensitive can reach a ledger entry (G6):
keys of `details` and `payload` that read like token ids, prompts, salts, secrets or key material are
refused with `SensitiveFieldError` naming the field (never echoing its value), and so are values that
look like them (PEM blocks, long runs of integers that read like token ids, long free text).

Time is injected: `ts` comes from the caller's clock and must be timezone-aware; it is normalised to
UTC. The optional `payload` holds personal or tenant-identifying detail: it never enters the leaf,
only a salted commitment does (see `kvguard.audit.leaf`), so it can be erased later.
"""

from __future__ import annotations

import functools
import math
import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvguard.errors import SensitiveFieldError
from kvguard.logging import is_sensitive_name

EVENT_SCHEMA_VERSION: Final = 1
MAX_TEXT = 200  # a detail longer than this reads like free text (a prompt), not a fact
MAX_BLOCK_IDS = 4096
MAX_BLOCK_ID: Final = (1 << 63) - 1  # the largest id the ledger's block index (a BIGINT) holds
_MAX_DETAILS = 64

DetailValue = str | int | float | bool | None

# Integer fields named like `num_tokens` or `tokens_matched` are counts, not token ids.
_COUNT_WORDS = frozenset({"count", "matched", "avoided", "total", "len", "length", "num", "n"})
_WORD_SPLIT = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")
_EXTRA_SENSITIVE = frozenset({"text", "content", "completion", "messages", "hmac", "pem"})
_TOKEN_LIST = re.compile(r"^\s*\[?\s*-?\d+(\s*[,;\s]\s*-?\d+){7,}")
_PEM = re.compile(r"-----BEGIN [A-Z ]+-----")
# A lone surrogate has no UTF-8 form: the leaf encoder could not write the event, and a ledger
# writer would retry its batch for ever (every event queued behind it with it).
_SURROGATE = re.compile("[\ud800-\udfff]")


class EventKind(StrEnum):
    """What happened. New kinds are added, never repurposed (the schema is versioned)."""

    BLOCK_ALLOC = "block.alloc"
    BLOCK_REUSE = "block.reuse"
    BLOCK_RELEASE = "block.release"
    BLOCK_EVICT = "block.evict"
    BLOCK_ZEROIZE = "block.zeroize"
    SESSION_PURGE = "session.purge"
    TENANT_PURGE = "tenant.purge"
    MODEL_PURGE = "model.purge"
    ADAPTER_PURGE = "adapter.purge"
    POLICY_CHANGE = "policy.change"
    ADMIN_ACTION = "admin.action"
    KEY_ROTATE = "key.rotate"
    PAYLOAD_ERASE = "payload.erase"
    CUSTODY_REPAIR = "custody.repair"
    QUOTA_DEFER = "quota.defer"
    QUOTA_REJECT = "quota.reject"
    BLOCK_SPILL = "block.spill"
    BLOCK_RESTORE = "block.restore"
    KEY_SHRED = "key.shred"
    TIER_AUTH_FAILURE = "tier.auth_failure"


# Integers a leaf may hold: at most 603 digits, within the 640 every Python reader parses (the
# lowest `int_max_str_digits` allowed) and `kvguard.audit.bundle`'s event pattern admits.
MAX_INT_BITS = 2000


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORD_SPLIT.split(name) if w]


@functools.lru_cache(maxsize=4096)
def _name_verdict(name: str) -> tuple[bool, bool]:
    """(reads like sensitive material, reads like a count) for a field name. Cached: detail names
    come from a small fixed vocabulary, and this check ran for every field of every engine event."""
    words = _words(name)
    countish = bool(words) and (words[-1] in _COUNT_WORDS or words[0] in _COUNT_WORDS)
    return is_sensitive_name(name) or bool(set(words) & _EXTRA_SENSITIVE), countish


def _check_field(where: str, name: str, value: DetailValue) -> None:
    """Raise SensitiveFieldError if `name` or `value` reads like G6 material. Names only, no values."""
    sensitive, countish = _name_verdict(name)
    is_count = isinstance(value, int) and not isinstance(value, bool) and countish
    if sensitive and not is_count:
        raise SensitiveFieldError(f"{where}.{name}: field name reads like sensitive material (G6)")
    if isinstance(value, str):
        if not value.isascii() and _SURROGATE.search(value):
            raise ValueError(f"{where}.{name}: a lone surrogate (U+D800-U+DFFF) has no UTF-8 form")
        if len(value) > MAX_TEXT:
            raise SensitiveFieldError(
                f"{where}.{name}: {len(value)} characters reads like free text"
            )
        if _PEM.search(value):
            raise SensitiveFieldError(f"{where}.{name}: value holds a PEM block (key material)")
        if _TOKEN_LIST.match(value):
            raise SensitiveFieldError(f"{where}.{name}: value reads like a list of token ids")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}.{name}: non-finite numbers have no canonical JSON form")


@functools.lru_cache(maxsize=4096)
def _plain_value_ok(name: str, is_int: bool) -> bool:
    """True when any int (`is_int`) or any bool / None under `name` passes `_check_field`: what is
    checked then depends on the name and the type alone, so the verdict is cached."""
    sensitive, countish = _name_verdict(name)
    return not sensitive or (is_int and countish)


def _check_mapping(where: str, mapping: dict[str, DetailValue] | None) -> None:
    for name, value in (mapping or {}).items():
        if not name.isascii() and _SURROGATE.search(name):
            raise ValueError(f"{where}: a field name with a lone surrogate (U+D800-U+DFFF)")
        kind = type(value)
        if kind is int and value.bit_length() > MAX_INT_BITS:  # type: ignore[union-attr]
            raise ValueError(f"{where}.{name}: an integer of over {MAX_INT_BITS} bits")
        if (kind is int or kind is bool or value is None) and _plain_value_ok(name, kind is int):
            continue
        _check_field(where, name, value)


class AuditEvent(BaseModel):
    """One auditable fact. Frozen: an event is evidence once made."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=True)

    v: Literal[1] = EVENT_SCHEMA_VERSION
    kind: EventKind
    scope_tag: str | None = Field(default=None, max_length=128, pattern=r"^[\x21-\x7e]+$")
    request_id: str | None = Field(default=None, max_length=128, pattern=r"^[\x21-\x7e]+$")
    block_ids: list[int] = Field(default_factory=list, max_length=MAX_BLOCK_IDS)
    details: dict[str, DetailValue] = Field(default_factory=dict, max_length=_MAX_DETAILS)
    ts: datetime
    payload: dict[str, DetailValue] | None = Field(default=None, max_length=_MAX_DETAILS)

    @field_validator("ts")
    @classmethod
    def _utc(cls, ts: datetime) -> datetime:
        if ts.tzinfo is None or ts.utcoffset() is None:
            raise ValueError("ts must be timezone-aware (inject a UTC clock)")
        return ts.astimezone(UTC)

    @field_validator("block_ids")
    @classmethod
    def _block_ids(cls, ids: list[int]) -> list[int]:
        if any(i < 0 for i in ids):
            raise ValueError("block ids are non-negative")
        if any(i > MAX_BLOCK_ID for i in ids):
            # The block index column is a BIGINT: an entry naming a larger id would validate and
            # then fail every insert, and the writer, retrying it as an outage, would store
            # nothing after it (found by a review: one such entry stopped the ledger for good).
            raise ValueError("a block id past 2**63 - 1 (the ledger's block index holds 64 bits)")
        return ids

    @field_validator("details")
    @classmethod
    def _details(cls, details: dict[str, DetailValue]) -> dict[str, DetailValue]:
        _check_mapping("details", details)
        return details

    @field_validator("payload")
    @classmethod
    def _payload(cls, payload: dict[str, DetailValue] | None) -> dict[str, DetailValue] | None:
        _check_mapping("payload", payload)
        return payload
