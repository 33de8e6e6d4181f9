"""Property tests: the decision functions' invariants hold over generated policies and scopes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.isolation import ModelRef, Scope, Share
from kvguard.policy import (
    MAX_REUSE,
    BlockState,
    Classification,
    PolicySet,
    Reuse,
    TenantPolicy,
    Usage,
    Verdict,
    ZeroizeOn,
    admit,
    expired,
    may_reuse,
    must_zeroize,
    over_quota,
)
from tests.policy.conftest import PREFIX_DIGEST, scope

TENANTS = ["a", "b", "c"]
GROUPS = ["g", "h"]


@st.composite
def tenant_policies(draw: st.DrawFn) -> dict[str, Any]:
    classification = draw(st.sampled_from(list(Classification)))
    allowed = [r for r in Reuse if r.rank <= MAX_REUSE[classification].rank]
    reuse = draw(st.sampled_from(allowed))
    data: dict[str, Any] = {
        "classification": classification,
        "reuse": reuse,
        "enabled": draw(st.booleans()),
    }
    if classification is not Classification.RESTRICTED:
        groups = draw(st.lists(st.sampled_from(GROUPS), unique=True, min_size=reuse is Reuse.GROUP))
        data["groups"] = groups
        data["zeroize"] = {"on_release": draw(st.sampled_from(list(ZeroizeOn)))}
    return data


@st.composite
def policy_sets(draw: st.DrawFn) -> PolicySet:
    group = {"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}]}
    return PolicySet.model_validate(
        {
            "epoch": draw(st.integers(0, 1)),
            "default": {"reuse": draw(st.sampled_from([Reuse.NONE, Reuse.SESSION, Reuse.TENANT]))},
            "tenants": draw(st.dictionaries(st.sampled_from(TENANTS), tenant_policies())),
            "share_groups": {g: group for g in GROUPS},
        }
    )


@st.composite
def scopes(draw: st.DrawFn) -> Scope:
    share = draw(st.sampled_from(list(Share)))
    extra: dict[str, Any] = {}
    if share is Share.SESSION:
        extra["session_id"] = draw(st.sampled_from(["s1", "s2"]))
    if share is Share.GROUP:
        extra["group_id"] = draw(st.sampled_from([*GROUPS, "x"]))
    return scope(
        draw(st.sampled_from([*TENANTS, "unknown"])),
        share,
        model=ModelRef(id="m", revision=draw(st.sampled_from(["r1", "r2"]))),
        policy_epoch=draw(st.integers(0, 1)),
        **extra,
    )


def _consents(ps: PolicySet, tenant: str, share: Share, group: str | None) -> bool:
    policy = ps.policy_for(tenant)
    if not policy.enabled or not policy.reuse.allows(share):
        return False
    return share is not Share.GROUP or group in policy.groups


@settings(max_examples=400, deadline=None)
@given(policy_sets(), scopes(), scopes())
def test_G1_may_reuse_never_crosses_tenants_without_both_consenting(
    ps: PolicySet, block: Scope, request: Scope
) -> None:
    if not may_reuse(ps, block, request):
        return
    assert block.same_domain(request)
    assert block.policy_epoch == ps.epoch
    if block.tenant_id != request.tenant_id:
        assert request.share in (Share.GROUP, Share.PUBLIC)
    for tenant in (block.tenant_id, request.tenant_id):
        assert _consents(ps, tenant, request.share, request.group_id)
        assert ps.policy_for(tenant).classification is not Classification.RESTRICTED


@settings(deadline=None)  # a shared, loaded CPU must not turn slowness into failures
@given(policy_sets(), scopes(), scopes())
def test_may_reuse_is_symmetric(ps: PolicySet, x: Scope, y: Scope) -> None:
    assert may_reuse(ps, x, y) == may_reuse(ps, y, x)


@settings(max_examples=300, deadline=None)
@given(policy_sets(), scopes(), st.integers(0, 20), st.integers(0, 20), st.integers(0, 20))
def test_admitted_scope_is_never_wider_than_asked_or_allowed(
    ps: PolicySet, request: Scope, active: int, cached: int, requested: int
) -> None:
    usage = Usage(blocks_active=active, blocks_cached=cached, blocks_requested=requested)
    decision = admit(ps, request, usage)
    policy = ps.policy_for(request.tenant_id)
    if not decision.admitted:
        assert decision.scope is None
        return
    assert policy.enabled
    assert decision.scope is not None
    assert decision.scope.tenant_id == request.tenant_id
    assert Reuse(decision.scope.share.value).rank <= Reuse(request.share.value).rank
    if decision.verdict is Verdict.ADMIT:
        # A cached request's blocks are ones its own tenant may reuse: admit and may_reuse agree.
        assert may_reuse(ps, decision.scope, decision.scope)
        assert not over_quota(policy, usage)
        assert policy.classification is not Classification.RESTRICTED
    else:
        assert decision.scope.share in (Share.SESSION, Share.TENANT)


finite_times = st.floats(-1e9, 1e9, allow_nan=False)


@settings(deadline=None)  # a shared, loaded CPU must not turn slowness into failures
@given(
    st.integers(0, 10_000),
    st.integers(0, 10_000),
    finite_times,
    st.floats(0, 1e6),
    finite_times,
    st.floats(0, 1e6),
)
def test_expired_is_monotone_in_time(
    ttl: int, idle: int, created: float, used_after: float, now: float, later_by: float
) -> None:
    policy = TenantPolicy.model_validate({"retention": {"ttl_s": max(ttl, idle), "idle_s": idle}})
    block = BlockState(scope=scope(), created_at=created, last_used_at=created + used_after)
    if expired(policy, block, now):
        assert expired(policy, block, now + later_by)


@settings(deadline=None)  # a shared, loaded CPU must not turn slowness into failures
@given(finite_times, st.floats(0, 1e6), finite_times)
def test_restricted_blocks_are_always_expired(
    created: float, used_after: float, now: float
) -> None:
    policy = TenantPolicy.model_validate({"classification": "restricted"})
    block = BlockState(scope=scope(), created_at=created, last_used_at=created + used_after)
    assert expired(policy, block, now)


@settings(deadline=None)  # a shared, loaded CPU must not turn slowness into failures
@given(st.sampled_from(list(ZeroizeOn)), scopes(), st.none() | scopes())
def test_G3_no_dirty_handover_outside_the_reuse_domain(
    on_release: ZeroizeOn, owner: Scope, next_scope: Scope | None
) -> None:
    policy = TenantPolicy.model_validate({"zeroize": {"on_release": on_release}})
    block = BlockState(scope=owner, created_at=0.0, last_used_at=0.0)
    if not must_zeroize(policy, block, next_scope):
        assert on_release is ZeroizeOn.CROSS_SCOPE
        assert next_scope is not None and owner.same_domain(next_scope)


@settings(deadline=None)  # a shared, loaded CPU must not turn slowness into failures
@given(
    st.integers(1, 100),
    st.integers(0, 100),
    st.integers(0, 100),
    st.integers(0, 100),
    st.integers(0, 5),
)
def test_over_quota_is_monotone_in_usage(
    cap: int, active: int, cached: int, requested: int, more: int
) -> None:
    policy = TenantPolicy.model_validate({"quota": {"max_blocks": cap}})
    if over_quota(policy, Usage(active, cached, requested)):
        assert over_quota(policy, Usage(active + more, cached, requested))
        assert over_quota(policy, Usage(active, cached + more, requested))
        assert over_quota(policy, Usage(active, cached, requested + more))
