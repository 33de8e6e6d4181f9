"""Decision functions over every combination of the policy vocabularies (G1, G2, G7)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvguard.isolation import ModelRef, Share
from kvguard.policy import (
    MAX_REUSE,
    BlockState,
    Classification,
    LedgerUnavailable,
    PolicySet,
    Reason,
    Retention,
    Reuse,
    TenantPolicy,
    Usage,
    Verdict,
    ZeroizeOn,
    admit,
    expired,
    may_reuse,
    may_share_prefix,
    must_zeroize,
    over_quota,
)
from tests.policy.conftest import PREFIX_DIGEST, policy_set, scope

VALID = [(c, r) for c in Classification for r in Reuse if r.rank <= MAX_REUSE[c].rank]


def _tenant(classification: Classification, reuse: Reuse, *, member: bool = True) -> dict[str, Any]:
    data: dict[str, Any] = {"classification": classification, "reuse": reuse}
    if classification is not Classification.RESTRICTED and (member or reuse is Reuse.GROUP):
        data["groups"] = ["g"]
    return data


def _two_groups(tenants: dict[str, dict[str, Any]], **top: Any) -> PolicySet:
    group = {"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}]}
    return policy_set(tenants, share_groups={"g": group, "h": group}, **top)


def _request(share: Share, group: str = "g", tenant: str = "acme") -> Any:
    return scope(tenant, share, group_id=group) if share is Share.GROUP else scope(tenant, share)


# --- admit -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("classification", "reuse"), VALID)
@pytest.mark.parametrize("share", list(Share))
@pytest.mark.parametrize("group", ["g", "h"])  # member of g, not of h
def test_admit_every_reuse_and_share(
    classification: Classification, reuse: Reuse, share: Share, group: str
) -> None:
    ps = _two_groups({"acme": _tenant(classification, reuse)})
    request = _request(share, group)
    decision = admit(ps, request, Usage())
    member = share is not Share.GROUP or group == "g"
    if reuse is Reuse.NONE:
        assert (decision.verdict, decision.reason) == (Verdict.ADMIT_WITHOUT_CACHE, Reason.NO_REUSE)
    elif reuse.allows(share) and member:
        assert (decision.verdict, decision.reason, decision.scope) == (
            Verdict.ADMIT,
            Reason.OK,
            request,
        )
    elif reuse.allows(Share.TENANT):
        assert (decision.verdict, decision.reason) == (Verdict.ADMIT, Reason.SHARE_NARROWED)
        assert decision.scope == request.with_share(Share.TENANT)
    else:
        assert (decision.verdict, decision.reason) == (
            Verdict.ADMIT_WITHOUT_CACHE,
            Reason.SHARE_NOT_ALLOWED,
        )
    assert decision.scope is not None and decision.scope.tenant_id == "acme"
    if not decision.use_cache:
        # Blocks of an uncached request are owned privately, never by a shared domain.
        assert decision.scope.share in (Share.SESSION, Share.TENANT)


def test_restricted_is_admitted_without_cache() -> None:
    ps = policy_set({"lab": {"classification": "restricted"}})
    decision = admit(ps, scope("lab", Share.PUBLIC), Usage())
    assert decision.verdict is Verdict.ADMIT_WITHOUT_CACHE and decision.admitted
    assert not decision.use_cache
    assert decision.scope is not None and decision.scope.share is Share.TENANT


def test_disabled_tenant_and_stale_epoch_are_rejected() -> None:
    ps = policy_set({"gone": {"enabled": False}}, epoch=2)
    assert admit(ps, scope("gone", policy_epoch=2), Usage()).reason is Reason.TENANT_DISABLED
    stale = admit(ps, scope("acme", policy_epoch=1), Usage())
    assert (stale.verdict, stale.reason, stale.scope) == (Verdict.REJECT, Reason.STALE_EPOCH, None)
    assert not stale.admitted
    assert admit(ps, scope("acme", policy_epoch=2), Usage()).verdict is Verdict.ADMIT


@pytest.mark.parametrize("behaviour", list(LedgerUnavailable))
@pytest.mark.parametrize("available", [True, False])
def test_ledger_unavailable_fails_closed_or_defers(
    behaviour: LedgerUnavailable, available: bool
) -> None:
    ps = policy_set({"acme": {"on_ledger_unavailable": behaviour}})
    decision = admit(ps, scope(), Usage(), ledger_available=available)
    if available:
        assert decision.verdict is Verdict.ADMIT
    elif behaviour is LedgerUnavailable.BLOCK:
        assert (decision.verdict, decision.reason) == (Verdict.DEFER, Reason.LEDGER_UNAVAILABLE)
    else:
        assert (decision.verdict, decision.reason) == (Verdict.REJECT, Reason.LEDGER_UNAVAILABLE)
    assert available == decision.admitted


@pytest.mark.parametrize(
    ("active", "cached", "requested", "verdict"),
    [
        (0, 0, 10, Verdict.ADMIT),  # exactly at the cap
        (4, 6, 0, Verdict.ADMIT),
        (0, 0, 11, Verdict.REJECT),  # the request alone passes the cap
        (5, 0, 6, Verdict.REJECT),  # live work passes the cap: evicting cache cannot help
        (5, 5, 1, Verdict.ADMIT_WITHOUT_CACHE),  # only cached blocks push it over
        (0, 100, 10, Verdict.ADMIT_WITHOUT_CACHE),
    ],
)
def test_quota(active: int, cached: int, requested: int, verdict: Verdict) -> None:
    ps = policy_set({"acme": {"quota": {"max_blocks": 10}}})
    usage = Usage(blocks_active=active, blocks_cached=cached, blocks_requested=requested)
    decision = admit(ps, scope(), usage)
    assert decision.verdict is verdict
    assert over_quota(ps.policy_for("acme"), usage) == (verdict is not Verdict.ADMIT)
    if verdict is not Verdict.ADMIT:
        assert decision.reason is Reason.QUOTA_EXCEEDED


def test_no_cap_is_never_over_quota_and_usage_is_validated() -> None:
    assert not over_quota(TenantPolicy(), Usage(blocks_cached=1 << 40, blocks_requested=1 << 40))
    for bad in ({"blocks_active": -1}, {"blocks_cached": True}, {"blocks_requested": 1.5}):
        with pytest.raises(ValueError, match="non-negative integer"):
            Usage(**bad)


# --- may_reuse ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), list(itertools.product(VALID, repeat=2)))
@pytest.mark.parametrize("share", list(Share))
def test_may_reuse_across_tenants_needs_a_shared_domain_and_both_consents(
    a: tuple[Classification, Reuse], b: tuple[Classification, Reuse], share: Share
) -> None:
    ps = _two_groups({"acme": _tenant(*a), "globex": _tenant(*b)})
    block, request = _request(share, tenant="acme"), _request(share, tenant="globex")
    both_allow = a[1].allows(share) and b[1].allows(share)
    members = all(c is not Classification.RESTRICTED for c, _ in (a, b))
    expected = (share is Share.PUBLIC and both_allow) or (
        share is Share.GROUP and both_allow and members
    )
    assert may_reuse(ps, block, request) is expected
    assert may_reuse(ps, request, block) is expected


@pytest.mark.parametrize(("classification", "reuse"), VALID)
@pytest.mark.parametrize("share", list(Share))
def test_may_reuse_within_a_tenant_follows_its_allowance(
    classification: Classification, reuse: Reuse, share: Share
) -> None:
    ps = _two_groups({"acme": _tenant(classification, reuse)})
    request = _request(share)
    member = classification is not Classification.RESTRICTED
    expected = reuse.allows(share) and (share is not Share.GROUP or member)
    assert may_reuse(ps, request, request) is expected


def test_may_reuse_refuses_group_not_joined_or_undefined() -> None:
    ps = _two_groups({"acme": _tenant(Classification.INTERNAL, Reuse.PUBLIC)})
    assert may_reuse(ps, _request(Share.GROUP, "g"), _request(Share.GROUP, "g"))
    assert not may_reuse(ps, _request(Share.GROUP, "h"), _request(Share.GROUP, "h"))
    assert not may_reuse(ps, _request(Share.GROUP, "x"), _request(Share.GROUP, "x"))


def test_may_reuse_refuses_any_domain_difference() -> None:
    ps = policy_set({"acme": {"reuse": "public"}, "globex": {"reuse": "public"}}, epoch=1)
    base = scope(share=Share.PUBLIC, policy_epoch=1)
    assert may_reuse(ps, base, base.model_copy(update={"tenant_id": "globex"}))
    other_model = scope(share=Share.PUBLIC, policy_epoch=1, model=ModelRef(id="m", revision="r2"))
    assert not may_reuse(ps, base, other_model)
    old = scope(share=Share.PUBLIC, policy_epoch=0)
    assert not may_reuse(ps, old, old)  # both old: same domain, but not the current epoch
    assert not may_reuse(
        ps, scope("acme", Share.SESSION), scope("acme", Share.SESSION, session_id="s2")
    )


def test_disabled_tenant_reuses_nothing() -> None:
    ps = policy_set({"acme": {"enabled": False}})
    assert not may_reuse(ps, scope(), scope())


def test_may_share_prefix() -> None:
    ps = policy_set(share_groups={"g": {"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}]}})
    assert may_share_prefix(ps, "g", PREFIX_DIGEST, 256)
    assert not may_share_prefix(ps, "g", PREFIX_DIGEST, 255)  # default min_shared_tokens
    assert not may_share_prefix(ps, "g", "sha256:" + "0" * 64, 4096)
    assert not may_share_prefix(ps, "nope", PREFIX_DIGEST, 4096)


# --- expired / must_zeroize --------------------------------------------------------------------


def _retention(ttl: int, idle: int) -> TenantPolicy:
    return TenantPolicy.model_validate({"retention": {"ttl_s": ttl, "idle_s": idle}})


@pytest.mark.parametrize(
    ("ttl", "idle", "created", "used", "now", "expected"),
    [
        (100, 10, 0.0, 0.0, 9.9, False),
        (100, 10, 0.0, 0.0, 10.0, True),  # idle limit reached exactly
        (100, 10, 0.0, 95.0, 99.9, False),
        (100, 10, 0.0, 95.0, 100.0, True),  # TTL counts from creation, however recent the use
        (0, 0, 50.0, 50.0, 50.0, True),  # no retention
        (0, 0, 50.0, 50.0, 10.0, True),  # ... even if the clock stepped back
        (100, 10, 50.0, 55.0, 0.0, False),  # clock stepped back: never "younger than new"
    ],
)
def test_expired(
    ttl: int, idle: int, created: float, used: float, now: float, expected: bool
) -> None:
    block = BlockState(scope=scope(), created_at=created, last_used_at=used)
    assert expired(_retention(ttl, idle), block, now) is expected


def test_expired_refuses_non_finite_time_and_block_state_is_validated() -> None:
    block = BlockState(scope=scope(), created_at=0.0, last_used_at=0.0)
    with pytest.raises(ValueError, match="finite"):
        expired(TenantPolicy(), block, float("nan"))
    with pytest.raises(ValueError, match="earlier"):
        BlockState(scope=scope(), created_at=5.0, last_used_at=4.0)
    with pytest.raises(ValueError, match="finite"):
        BlockState(scope=scope(), created_at=float("inf"), last_used_at=float("inf"))


@pytest.mark.parametrize("on_release", list(ZeroizeOn))
@pytest.mark.parametrize("next_kind", ["none", "same", "other_tenant", "other_model"])
def test_must_zeroize(on_release: ZeroizeOn, next_kind: str) -> None:
    policy = TenantPolicy.model_validate({"zeroize": {"on_release": on_release}})
    block = BlockState(scope=scope(), created_at=0.0, last_used_at=0.0)
    next_scope = {
        "none": None,
        "same": scope(),
        "other_tenant": scope("globex"),
        "other_model": scope(model=ModelRef(id="m", revision="r2")),
    }[next_kind]
    expected = on_release is ZeroizeOn.ALWAYS or next_kind != "same"
    assert must_zeroize(policy, block, next_scope) is expected


def test_ttl_clock_step_back_is_clamped_even_without_the_idle_rule() -> None:
    # The invariants make idle_s <= ttl_s, which hides the TTL clamp; build past them to pin it.
    policy = TenantPolicy.model_construct(
        retention=Retention.model_construct(ttl_s=0, idle_s=10**6)
    )
    block = BlockState(scope=scope(), created_at=50.0, last_used_at=50.0)
    assert expired(policy, block, 10.0)


def test_shared_prefix_tokens_follows_the_allow_list_and_min_shared_tokens() -> None:
    from kvguard.policy import PolicySet, prefix_digest, shared_prefix_tokens  # noqa: PLC0415

    prefix = list(range(5, 69))  # 64 tokens
    groups = {
        "g": {
            "prefixes": [{"id": "p", "digest": prefix_digest(prefix), "tokens": 64}],
            "min_shared_tokens": 64,
        },
        "g-nolen": {
            "prefixes": [{"id": "p", "digest": prefix_digest(prefix)}],
            "min_shared_tokens": 64,
        },
        "g-long": {
            "prefixes": [{"id": "p", "digest": prefix_digest(prefix)}],
            "min_shared_tokens": 65,
        },
    }
    ps = PolicySet.model_validate({"share_groups": groups})
    assert shared_prefix_tokens(ps, "g", [*prefix, 1, 2, 3], 32) == 64
    assert shared_prefix_tokens(ps, "g-nolen", [*prefix, 1, 2, 3], 32) == 64  # block-aligned search
    assert shared_prefix_tokens(ps, "g", prefix[:-1], 32) == 0  # shorter than the listed prefix
    assert shared_prefix_tokens(ps, "g", [9, *prefix], 32) == 0  # does not start with it
    assert shared_prefix_tokens(ps, "g-long", [*prefix, 1], 32) == 0  # below min_shared_tokens
    assert shared_prefix_tokens(ps, "nope", prefix, 32) == 0


def test_shared_prefix_tokens_hashes_a_bounded_span_of_a_long_prompt(monkeypatch: Any) -> None:
    """A prefix listed without `tokens` is looked for at every block-aligned length: each a SHA-256
    over the prompt up to it, so a long prompt cost quadratic hashing on the scheduler thread (a
    4,096-token prompt hashed 526,320 ids; found by a review). The search stops at
    `UNSIZED_PREFIX_MAX_TOKENS`, and the ids are encoded once."""
    import kvguard.policy.decisions as d  # noqa: PLC0415
    from kvguard.policy import PolicySet, prefix_digest, shared_prefix_tokens  # noqa: PLC0415

    hashed = [0]
    real = d.packed_digest

    def counting(packed: bytes, count: int) -> str:
        hashed[0] += count
        return real(packed, count)

    monkeypatch.setattr(d, "packed_digest", counting)
    ps = PolicySet.model_validate(
        {
            "share_groups": {
                "g": {"prefixes": [{"id": "p", "digest": prefix_digest(range(32))}]},
                "h": {"prefixes": [{"id": "q", "digest": prefix_digest(range(64)), "tokens": 64}]},
            }
        }
    )
    cap = d.UNSIZED_PREFIX_MAX_TOKENS
    # min_shared_tokens is 256 by default: a 32-token prefix never qualifies, so every length is
    # tried and none matches; no length past the cap is hashed.
    assert shared_prefix_tokens(ps, "g", list(range(100_000)), 16) == 0
    assert hashed[0] <= cap * (cap // 16) // 2 + cap
    hashed[0] = 0
    assert shared_prefix_tokens(ps, "h", list(range(100_000)), 16) == 0  # 64 < min_shared_tokens
    assert hashed[0] == 0  # a sized prefix under the minimum is not even hashed
    assert prefix_digest([1, 2, 3]) == d.packed_digest(d.packed_ids([1, 2, 3, 4]), 3)
    with pytest.raises(ValueError, match="token ids"):
        prefix_digest([-1])
