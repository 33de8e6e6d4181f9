"""Policy documents: what a compliance admin sets, as frozen, validated pydantic models.

A `PolicySet` is one whole document: a default `TenantPolicy` for tenants it does not name, one policy per
named tenant, and the share groups through which tenants may deliberately share cached prefixes. Every
field has a secure default (docs/policy.md says why for each), unknown keys are refused (a typo such as
`ttl: 0` instead of `ttl_s: 0` must not silently fall back to a weaker default), and cross-field rules
live in `kvguard.policy.invariants`, reported with the field path they concern.

Times are whole seconds, counts are blocks. Prefixes are named by a stable id and a digest, never by
their text (G6): a policy document is exported, logged and diffed, so it must not carry prompts.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvguard.isolation.scope import TenantId
from kvguard.policy.enums import (
    AuditLevel,
    Classification,
    LedgerUnavailable,
    QuotaFull,
    Reuse,
    Verify,
    ZeroizeOn,
)
from kvguard.policy.invariants import policy_set_problems, tenant_problems

SCHEMA_VERSION: Final = 1
# The longest a block may be retained: a month. Unlimited retention is not offered at all, because an
# unbounded cache is an unbounded exposure window; a caller that wants "long" has to say how long.
MAX_RETENTION_S: Final = 30 * 24 * 3600
INVARIANT_ERROR: Final = "policy_invariant"
STORED: Final = "stored"  # validation context: a document read back from the policy store
_ID_MAX: Final = 256
_PREFIX_LABEL: Final = b"kvguard/prefix/v1"

Identifier = Annotated[str, Field(min_length=1, max_length=_ID_MAX)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Retention(_Frozen):
    """How long cached blocks may live: `ttl_s` since creation, `idle_s` since last use."""

    ttl_s: int = Field(default=3600, ge=0, le=MAX_RETENTION_S)
    idle_s: int = Field(default=600, ge=0, le=MAX_RETENTION_S)


class Quota(_Frozen):
    """How many blocks (active + cached) the tenant may hold; None means no per-tenant cap.
    `when_full`: a request its running work would take past the cap waits, or is refused (429)."""

    max_blocks: int | None = Field(default=None, ge=1, lt=1 << 40)
    when_full: QuotaFull = QuotaFull.WAIT


class Zeroize(_Frozen):
    """When released blocks are zeroized and how the zeroization is verified."""

    on_release: ZeroizeOn = ZeroizeOn.ALWAYS
    verify: Verify = Verify.SAMPLE


class Offload(_Frozen):
    """Whether the tenant's cached blocks may be kept in the engine's encrypted offload tier when
    the device evicts them (docs/offload.md). Off unless the admin turns it on.

    `max_bytes`: ciphertext bytes the tenant may hold in the tier (None: the engine's whole tier
    budget). `ttl_s`: how long a block may stay in the tier. `disk`: its blocks may go to the
    engine's tier directory rather than memory (off: memory only; confidential data reaches a disk
    only when the admin says so, and a tenant_admin cannot turn it on)."""

    allowed: bool = False
    max_bytes: int | None = Field(default=None, ge=1, lt=1 << 50)
    ttl_s: int = Field(default=600, ge=0, le=MAX_RETENTION_S)
    disk: bool = False


class TenantPolicy(_Frozen):
    """Retention, sharing, quota, zeroization and audit rules for one tenant (or the default)."""

    classification: Classification = Classification.INTERNAL
    enabled: bool = True
    reuse: Reuse = Reuse.TENANT
    retention: Retention = Retention()
    quota: Quota = Quota()
    zeroize: Zeroize = Zeroize()
    audit: AuditLevel = AuditLevel.STANDARD
    groups: tuple[Identifier, ...] = ()
    offload: Offload = Offload()
    on_ledger_unavailable: LedgerUnavailable = LedgerUnavailable.FAIL_CLOSED

    @model_validator(mode="before")
    @classmethod
    def _restricted_defaults(cls, data: Any) -> Any:
        # A restricted tenant's *unset* fields take the only values restricted allows, so
        # `classification: restricted` alone is a complete, valid policy; explicit contradictions
        # are still refused by the invariants below.
        if not isinstance(data, dict) or data.get("classification") != Classification.RESTRICTED:
            return data
        out = dict(data)
        out.setdefault("reuse", Reuse.NONE)
        out["retention"] = _with_defaults(out.get("retention"), ttl_s=0, idle_s=0)
        out["zeroize"] = _with_defaults(out.get("zeroize"), verify=Verify.FULL)
        return out

    @field_validator("groups")
    @classmethod
    def _unique_groups(cls, groups: tuple[str, ...]) -> tuple[str, ...]:
        _refuse_duplicates(groups, "share group")
        # Sorted so that two documents that mean the same thing have the same canonical digest.
        return tuple(sorted(groups))

    @model_validator(mode="after")
    def _invariants(self) -> Self:
        # pydantic runs this again on an instance placed in a PolicySet being validated (every
        # entry of every edited or re-read set: 64 calls per write with 64 tenants). The rules
        # read only this frozen object's fields, so an object that passed them passes again:
        # each is checked once, remembered by identity (and held, so its id is not reused).
        # Only an object that cannot change is remembered: one built with `model_construct` may
        # hold a list where a tuple belongs, or a part of another type.
        if _checked.get(id(self)) is self:
            return self
        raise_problems(tenant_problems(self))
        if _immutable(self):
            if len(_checked) >= _CHECKED_MAX:
                _checked.clear()
            _checked[id(self)] = self
        return self


_CHECKED_MAX: Final = 4096
_checked: dict[int, TenantPolicy] = {}  # id -> a TenantPolicy that passed `tenant_problems`


def _immutable(policy: TenantPolicy) -> bool:
    """Whether every field `tenant_problems` reads is of its declared, frozen type (what
    validation builds; `model_construct` takes anything)."""
    return (
        type(policy) is TenantPolicy
        and type(policy.groups) is tuple
        and all(type(g) is str for g in policy.groups)
        and type(policy.retention) is Retention
        and type(policy.quota) is Quota
        and type(policy.zeroize) is Zeroize
        and type(policy.offload) is Offload
        and type(policy.classification) is Classification
        and type(policy.reuse) is Reuse
    )


class PrefixRef(_Frozen):
    """A prefix a share group may share: a stable name and the digest of its token ids."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    # The prefix's length in tokens (optional): lets the front end check one length instead of
    # every block-aligned one. The digest covers the length too, so a wrong value just never matches.
    tokens: int | None = Field(default=None, ge=1, le=1 << 24)


class ShareGroup(_Frozen):
    """Tenants that may reuse each other's KV state for the listed prefixes, and only those."""

    prefixes: tuple[PrefixRef, ...] = Field(min_length=1)
    # Short matches are the cheap probe (guess a short string, time the hit), so cross-tenant reuse
    # counts only from this many shared tokens on.
    min_shared_tokens: int = Field(default=256, ge=1, le=1 << 20)

    @field_validator("prefixes")
    @classmethod
    def _unique_prefixes(cls, prefixes: tuple[PrefixRef, ...]) -> tuple[PrefixRef, ...]:
        _refuse_duplicates((p.id for p in prefixes), "prefix id")
        _refuse_duplicates((p.digest for p in prefixes), "prefix digest")
        return prefixes

    def allows_prefix(self, digest: str) -> bool:
        return any(p.digest == digest for p in self.prefixes)


class PolicySet(_Frozen):
    """One whole policy document."""

    version: Literal[1] = SCHEMA_VERSION
    # Scopes carry the epoch; bumping it makes every existing salt, and so every cached block, stale.
    epoch: int = Field(default=0, ge=0, lt=1 << 63)
    default: TenantPolicy = Field(default_factory=TenantPolicy)
    tenants: dict[Identifier, TenantPolicy] = Field(default_factory=dict)
    share_groups: dict[Identifier, ShareGroup] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _invariants(self, info: ValidationInfo) -> Self:
        # A stored version is read as it was accepted when written: a rule added since (tenant
        # ids in the tenant id pattern) must not make a deployment's current policy unreadable.
        stored = bool(info.context and info.context.get(STORED))
        raise_problems(policy_set_problems(self, check_ids=not stored))
        return self

    def policy_for(self, tenant_id: TenantId | str) -> TenantPolicy:
        """The tenant's own policy, or the default for a tenant the document does not name."""
        return self.tenants.get(tenant_id, self.default)

    def canonical_json(self) -> str:
        """Sorted keys, no insignificant whitespace, every default spelled out (RFC 8785 style)."""
        return json.dumps(
            self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )

    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()


def prefix_digest(token_ids: Iterable[int]) -> str:
    """The digest a `PrefixRef` names: SHA-256 over a label, the count and each id as 4 bytes."""
    packed = packed_ids(list(token_ids))
    return packed_digest(packed, len(packed) // 4)


def packed_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as `prefix_digest` encodes them: 4 bytes each, big-endian (0 <= id < 2**32)."""
    try:
        return struct.pack(f">{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError("token ids must be integers in [0, 2**32)") from exc


def packed_digest(packed: bytes, count: int) -> str:
    """`prefix_digest` of the first `count` ids of `packed` (`packed_ids`)."""
    h = hashlib.sha256(_PREFIX_LABEL)
    h.update(struct.pack(">Q", count))
    h.update(packed[: 4 * count])
    return "sha256:" + h.hexdigest()


def raise_problems(problems: list[tuple[str, str]]) -> None:
    """Raise one pydantic error carrying every (relative field path, message) problem.

    pydantic gives a model validator's error the model's location only; carrying the problems in the
    error context lets the loader report each at its own field path (`tenants.acme.reuse`).
    """
    if problems:
        summary = "; ".join(f"{path}: {msg}" for path, msg in problems)
        raise PydanticCustomError(
            INVARIANT_ERROR, "{summary}", {"summary": summary, "problems": tuple(problems)}
        )


def _with_defaults(section: Any, **defaults: Any) -> Any:
    if section is None:
        return dict(defaults)
    if isinstance(section, dict):
        return {**defaults, **section}
    return section  # an already-built model (or garbage): validation judges it as given


def _refuse_duplicates(values: Iterable[str], what: str) -> None:
    """Refuse a repeated value, naming its position, not the value: an error body never echoes
    what was sent (G6: a key pasted into the wrong field must not come back)."""
    seen: set[str] = set()
    for position, value in enumerate(values, start=1):
        if value in seen:
            raise ValueError(f"duplicate {what} (entry {position} repeats an earlier one)")
        seen.add(value)
