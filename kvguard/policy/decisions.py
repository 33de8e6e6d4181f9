"""Pure policy decisions: admit, may-reuse, expired, must-zeroize, over-quota.

Every input is explicit and nothing is read from globals, so the engine wrapper, the custody core and
the tests all get the same answer from the same facts. Time is float seconds on one clock that the
caller chooses (UNIX time is the convention; whatever it is, `BlockState` timestamps and `now` must come
from the same clock). These functions decide; they never move blocks, zeroize or write the ledger.

The policy answers *whether*; isolation answers *what is the same*: `may_reuse` asks both (identical
reuse domain via `Scope.same_domain`, and both tenants' policies allow the share), so a bug in either
layer alone cannot produce a cross-tenant hit (G1, defence in depth).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from kvguard.isolation.scope import Scope, Share
from kvguard.policy.enums import LedgerUnavailable, Reuse, ZeroizeOn
from kvguard.policy.models import (
    PolicySet,
    ShareGroup,
    TenantPolicy,
    packed_digest,
    packed_ids,
)


class Verdict(StrEnum):
    """What admission says to do with a request."""

    ADMIT = "admit"
    # Run the request, but no prefix-cache lookup and no retention: its blocks are released (and
    # zeroized per policy) when it finishes.
    ADMIT_WITHOUT_CACHE = "admit_without_cache"
    REJECT = "reject"
    # Hold the request and ask again later (on_ledger_unavailable: block).
    DEFER = "defer"


class Reason(StrEnum):
    """Why admission decided as it did; stable strings, safe for logs and the ledger (G6)."""

    OK = "ok"
    SHARE_NARROWED = "share_narrowed"
    SHARE_NOT_ALLOWED = "share_not_allowed"
    NO_REUSE = "no_reuse"
    QUOTA_EXCEEDED = "quota_exceeded"
    TENANT_DISABLED = "tenant_disabled"
    STALE_EPOCH = "stale_epoch"
    LEDGER_UNAVAILABLE = "ledger_unavailable"


@dataclass(frozen=True, slots=True)
class Decision:
    """Admission result. `scope` is the scope to run under (possibly narrowed); None unless admitted."""

    verdict: Verdict
    reason: Reason
    scope: Scope | None = None

    @property
    def admitted(self) -> bool:
        return self.verdict in (Verdict.ADMIT, Verdict.ADMIT_WITHOUT_CACHE)

    @property
    def use_cache(self) -> bool:
        return self.verdict is Verdict.ADMIT


@dataclass(frozen=True, slots=True)
class Usage:
    """A tenant's block holdings when a request arrives, and what the request needs."""

    blocks_active: int = 0
    blocks_cached: int = 0
    blocks_requested: int = 0

    def __post_init__(self) -> None:
        for name in ("blocks_active", "blocks_cached", "blocks_requested"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer")

    @property
    def blocks_held(self) -> int:
        return self.blocks_active + self.blocks_cached


@dataclass(frozen=True, slots=True)
class BlockState:
    """What policy needs to know about one cached block: its scope and when it was made and used."""

    scope: Scope
    created_at: float
    last_used_at: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.created_at) and math.isfinite(self.last_used_at)):
            raise ValueError("block timestamps must be finite")
        if self.last_used_at < self.created_at:
            raise ValueError("last_used_at is earlier than created_at")


NO_USAGE: Final = Usage()  # a tenant holding nothing, asking for nothing (frozen: share it)


def over_quota(policy: TenantPolicy, usage: Usage) -> bool:
    """True when holding the requested blocks on top of what the tenant holds would pass its cap."""
    cap = policy.quota.max_blocks
    return cap is not None and usage.blocks_held + usage.blocks_requested > cap


def admit(
    policy_set: PolicySet, scope: Scope, usage: Usage, *, ledger_available: bool = True
) -> Decision:
    """Decide whether, and under which scope, a request may run (docs/policy.md, "admit").

    Checked in order, first match wins: disabled tenant, stale policy epoch, ledger unavailable (reject,
    or defer under `block`), quota that the tenant's *active* blocks alone would pass (reject), reuse
    'none' (no cache), quota passed only because of cached blocks (no cache: run, but do not grow the
    cache; custody may reclaim the tenant's own cached blocks), then the share: a share wider than the
    policy allows is narrowed to the tenant, never refused, because narrowing only removes sharing.
    """
    policy = policy_set.policy_for(scope.tenant_id)
    refusal = _refusal(policy_set, policy, scope, usage, ledger_available=ledger_available)
    return refusal if refusal is not None else _cache_decision(policy_set, policy, scope, usage)


def _refusal(
    policy_set: PolicySet,
    policy: TenantPolicy,
    scope: Scope,
    usage: Usage,
    *,
    ledger_available: bool,
) -> Decision | None:
    """The reasons not to run the request at all, or None."""
    if not policy.enabled:
        return Decision(Verdict.REJECT, Reason.TENANT_DISABLED)
    if scope.policy_epoch != policy_set.epoch:
        return Decision(Verdict.REJECT, Reason.STALE_EPOCH)
    if not ledger_available:
        held = policy.on_ledger_unavailable is LedgerUnavailable.BLOCK
        return Decision(Verdict.DEFER if held else Verdict.REJECT, Reason.LEDGER_UNAVAILABLE)
    cap = policy.quota.max_blocks
    if cap is not None and usage.blocks_active + usage.blocks_requested > cap:
        return Decision(Verdict.REJECT, Reason.QUOTA_EXCEEDED)
    return None


def _cache_decision(
    policy_set: PolicySet, policy: TenantPolicy, scope: Scope, usage: Usage
) -> Decision:
    """How an admitted request may use the cache, and under which scope."""
    if policy.reuse is Reuse.NONE:
        return _without_cache(Reason.NO_REUSE, scope)
    if over_quota(policy, usage):
        return _without_cache(Reason.QUOTA_EXCEEDED, scope)
    if _allowed(policy_set, policy, scope.share, scope.group_id):
        return Decision(Verdict.ADMIT, Reason.OK, scope)
    if policy.reuse.allows(Share.TENANT):
        return Decision(Verdict.ADMIT, Reason.SHARE_NARROWED, scope.with_share(Share.TENANT))
    # The allowance is 'session' but the request names no session: nothing it could share safely.
    return _without_cache(Reason.SHARE_NOT_ALLOWED, scope)


def private_scope(scope: Scope) -> Scope:
    """The owner scope for the blocks of a request that may not use the cache: private to the
    tenant. Under zeroize 'cross_scope', a block owned by a group or public scope would be handed to
    another tenant of that domain without zeroization."""
    if scope.share in (Share.SESSION, Share.TENANT):
        return scope
    return scope.with_share(Share.TENANT)


def _without_cache(reason: Reason, scope: Scope) -> Decision:
    return Decision(Verdict.ADMIT_WITHOUT_CACHE, reason, private_scope(scope))


def _allowed(
    policy_set: PolicySet, policy: TenantPolicy, share: Share, group_id: str | None
) -> bool:
    """True when `policy` lets its tenant use a scope shared at `share` (in `group_id`)."""
    if not policy.enabled or not policy.reuse.allows(share):
        return False
    if share is Share.GROUP:
        return group_id in policy.groups and group_id in policy_set.share_groups
    return True


def may_reuse(policy_set: PolicySet, block_scope: Scope, request_scope: Scope) -> bool:
    """True only when a block made under `block_scope` may serve a request under `request_scope`.

    Both the reuse domains must be identical and current, and the policies of *both* tenants (the
    block's creator and the requester) must allow the share: sharing needs consent on both sides.
    """
    if block_scope.policy_epoch != policy_set.epoch:
        return False
    if not block_scope.same_domain(request_scope):
        return False
    share, group = request_scope.share, request_scope.group_id
    return all(
        _allowed(policy_set, policy_set.policy_for(tenant), share, group)
        for tenant in (block_scope.tenant_id, request_scope.tenant_id)
    )


def may_share_prefix(
    policy_set: PolicySet, group_id: str, prefix_digest: str, shared_tokens: int
) -> bool:
    """True when a share group lists the prefix and the shared span is long enough to count."""
    group = policy_set.share_groups.get(group_id)
    if group is None:
        return False
    return group.allows_prefix(prefix_digest) and shared_tokens >= group.min_shared_tokens


# Prefixes listed without a `tokens` length are looked for at every block-aligned length up to
# this many tokens: each candidate is a SHA-256 over the prompt up to it, so without a bound a long
# prompt cost quadratic hashing on the scheduler thread (found by a review: 4,096 tokens hashed
# 526,320 token ids). Give a longer prefix its `tokens` (docs/policy.md).
UNSIZED_PREFIX_MAX_TOKENS: Final = 8192


def shared_prefix_tokens(
    policy_set: PolicySet, group_id: str, token_ids: Sequence[int], block_size: int
) -> int:
    """How many leading tokens of a prompt a share group may share: the longest listed prefix the
    prompt starts with, if it spans at least `min_shared_tokens`; 0 when none qualifies (the request
    then runs under its tenant's own scope). Prefixes without a `tokens` length are looked for at
    block-aligned lengths up to `UNSIZED_PREFIX_MAX_TOKENS` (only whole blocks are reused)."""
    group = policy_set.share_groups.get(group_id)
    if group is None or block_size <= 0:
        return 0
    lengths = {p.tokens for p in group.prefixes if p.tokens is not None}
    if any(p.tokens is None for p in group.prefixes):
        top = min(len(token_ids), UNSIZED_PREFIX_MAX_TOKENS)
        lengths.update(range(block_size, top + 1, block_size))
    best = 0
    packed: bytes | None = None
    for n in sorted(lengths, reverse=True):
        if n > len(token_ids) or n < group.min_shared_tokens:
            continue
        if packed is None:  # the ids once, as `prefix_digest` encodes them; each length a slice
            packed = packed_ids(token_ids[: max(lengths)])
        if may_share_prefix(policy_set, group_id, packed_digest(packed, n), n):
            best = n
            break
    return best


def expired(policy: TenantPolicy, block: BlockState, now: float) -> bool:
    """True when a cached block has outlived its TTL (since creation) or idle time (since last use).

    Ages are clamped at zero, so a clock that steps backwards never makes a block younger than new; a
    TTL of 0 therefore expires every cached block at once. Monotone: once true, true for any later now.
    """
    return expired_at(policy, block.created_at, block.last_used_at, now)


def expired_at(policy: TenantPolicy, created_at: float, last_used_at: float, now: float) -> bool:
    """`expired` for a block known by its two timestamps (custody's hot path builds no BlockState)."""
    if not math.isfinite(now):
        raise ValueError("now must be finite")
    age = max(0.0, now - created_at)
    idle = max(0.0, now - last_used_at)
    return age >= policy.retention.ttl_s or idle >= policy.retention.idle_s


EXPIRY_MARGIN_S = 1e-3


def expiry_deadline(policy: TenantPolicy, created_at: float, last_used_at: float) -> float:
    """A time before which `expired_at` is false for this block under this policy (-inf: it may be
    true at any time, e.g. a TTL of 0). An expiry sweep need not look at the block earlier; the
    verdict stays `expired_at`'s. A margin below the exact sum absorbs float rounding."""
    retention = policy.retention
    if retention.ttl_s <= 0 or retention.idle_s <= 0:
        return -math.inf
    exact = min(created_at + retention.ttl_s, last_used_at + retention.idle_s)
    return exact - EXPIRY_MARGIN_S


def must_zeroize(policy: TenantPolicy, block: BlockState, next_scope: Scope | None) -> bool:
    """True when a released block must be zeroized before `next_scope` (None: unknown) may get it.

    `policy` is the policy of the tenant that owns the block. Under `cross_scope` the only handover
    without zeroization is one into an identical reuse domain, which could have reused the block anyway.
    """
    return must_zeroize_owned(policy, block.scope, next_scope)


def must_zeroize_owned(policy: TenantPolicy, owner: Scope, next_scope: Scope | None) -> bool:
    """`must_zeroize` for a block known by its owner's scope (custody's hot path)."""
    if policy.zeroize.on_release is ZeroizeOn.ALWAYS or next_scope is None:
        return True
    return not owner.same_domain(next_scope)


def narrowed_groups(old: PolicySet, new: PolicySet) -> frozenset[str]:
    """Share groups whose sharing `new` narrows against `old`: gone, a listed prefix no longer
    listed (by id, digest and length), or a larger `min_shared_tokens`. What such a group cached
    under the old version may hold a prefix it no longer shares."""
    return frozenset(
        gid for gid, group in old.share_groups.items() if _narrows(group, new.share_groups.get(gid))
    )


def _narrows(old: ShareGroup, new: ShareGroup | None) -> bool:
    if new is None:
        return True
    listed = {(p.id, p.digest, p.tokens) for p in new.prefixes}
    return new.min_shared_tokens > old.min_shared_tokens or any(
        (p.id, p.digest, p.tokens) not in listed for p in old.prefixes
    )
