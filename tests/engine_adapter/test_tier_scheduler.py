"""The scheduler half of the offload tier (issue 15), over fakes: what is spilled, restored or
recomputed, and what purges, expiry and policy changes shred."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvguard.engine_adapter.records import EventKind, PurgeKind, PurgeSelector
from kvguard.engine_adapter.vllm.metadata import ShredDone, TierReport
from kvguard.engine_adapter.vllm.tier_scheduler import SchedulerTier, TierSettings
from kvguard.policy import PolicySet
from tests.engine_adapter.conftest import scope_for

pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")

BS = 16


@dataclass
class FakeRequest:
    request_id: str
    block_hashes: list[bytes]
    num_tokens: int


@dataclass
class FakeBlock:
    block_hash: bytes | None = None


@dataclass
class FakePool:
    blocks: list[FakeBlock] = field(default_factory=lambda: [FakeBlock() for _ in range(32)])


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


def policies(**tenants: dict[str, Any]) -> PolicySet:
    return PolicySet.model_validate({"tenants": tenants})


OFFLOAD = {"offload": {"allowed": True, "ttl_s": 100}}


class Harness:
    def __init__(self, policy: PolicySet, **settings: Any) -> None:
        self.policy = policy
        self.now = 1000.0
        self.tier = SchedulerTier(
            TierSettings(budget_bytes=settings.pop("budget", 10_000), **settings),
            block_size=BS,
            engine_id="e1",
            policies=lambda: self.policy,  # swapped by tests
            tag_for=lambda s: f"st_{s.tenant_id}",
            clock=lambda: self.now,
        )
        self.pool = FakePool()
        self.cached: set[int] = set()

    def finish(self, rid: str, tenant: str, blocks: list[int], n_hashes: int) -> FakeRequest:
        """A request of `tenant` ends; its blocks stay cached (hashes h0.. in order)."""
        hashes = [f"{tenant}-h{i}".encode() for i in range(n_hashes)]
        for i, b in enumerate(blocks):
            self.pool.blocks[b].block_hash = hashes[i] + b"\x00\x00\x00\x00"
            self.cached.add(b)
        req = FakeRequest(rid, hashes, n_hashes * BS + 1)
        self.tier.note_cached(req, scope_for(tenant), blocks, self.pool)
        return req

    def evict(self, blocks: list[int]) -> None:
        """vLLM's LRU hands these cached blocks to someone else."""
        self.tier.on_allocated(blocks, lambda b: b in self.cached)
        self.cached -= set(blocks)

    def worker_does(self) -> None:
        """The worker carries out the step's orders and reports them all as done."""
        spill, _drop, shred, load = self.tier.take_orders()
        report = TierReport(
            spilled=[(o, 1000) for o in spill],
            restored=list(load),
            shredded=[ShredDone(o, 0, 1, 1000) for o in shred],
        )
        self.tier.on_report(report)


def test_evicted_cached_blocks_of_allowed_tenants_are_spilled() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.finish("r1", "a", [1, 2], 2)
    h.finish("r2", "b", [3], 1)  # b's policy does not allow offload
    h.evict([1, 2, 3])
    spill, *_ = h.tier.take_orders()
    assert [(o.block_id, o.key.position) for o in spill] == [(1, 0), (2, 1)]


def test_blocks_retired_by_policy_before_eviction_are_not_spilled() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.finish("r1", "a", [1], 1)
    h.cached.discard(1)  # quarantined by expiry or a purge: not cached when vLLM takes it
    h.evict([1])
    assert h.tier.take_orders()[0] == ()


def test_a_repeat_restores_its_contiguous_run_and_another_tenant_gets_none() -> None:
    h = Harness(policies(a=OFFLOAD, b=OFFLOAD), restore_us_per_block=1, prefill_us_per_token=100)
    req = h.finish("r1", "a", [1, 2, 3], 3)
    h.evict([1, 2, 3])
    h.worker_does()
    again = FakeRequest("r2", req.block_hashes, req.num_tokens)
    assert h.tier.match(again, scope_for("a"), 0, None) == 3 * BS
    h.tier.after_alloc(again, [7, 8, 9, 10], 3 * BS)
    assert h.tier.take_external("r2") == 3 * BS
    *_, load = h.tier.take_orders()
    assert [(o.block_id, o.key.position) for o in load] == [(7, 0), (8, 1), (9, 2)]
    other = FakeRequest("r3", req.block_hashes, req.num_tokens)  # same hashes, other domain
    assert h.tier.match(other, scope_for("b"), 0, None) == 0


def test_the_last_token_and_a_share_limit_are_never_loaded() -> None:
    h = Harness(policies(a=OFFLOAD), restore_us_per_block=1, prefill_us_per_token=100)
    req = h.finish("r1", "a", [1, 2, 3], 3)
    h.evict([1, 2, 3])
    h.worker_does()
    exact = FakeRequest("r2", req.block_hashes, 3 * BS)  # the prompt ends on a block boundary
    assert h.tier.match(exact, scope_for("a"), 0, None) == 2 * BS
    capped = FakeRequest("r3", req.block_hashes, req.num_tokens)
    assert h.tier.match(capped, scope_for("a"), 0, share_tokens=BS) == BS
    after_local = FakeRequest("r4", req.block_hashes, req.num_tokens)
    assert h.tier.match(after_local, scope_for("a"), BS, None) == 2 * BS


def test_recompute_wins_when_measured_cheaper_and_is_recorded_once() -> None:
    h = Harness(policies(a=OFFLOAD), restore_us_per_block=1000, prefill_us_per_token=1)
    req = h.finish("r1", "a", [1, 2], 2)
    h.evict([1, 2])
    h.worker_does()
    h.tier.events.clear()
    again = FakeRequest("r2", req.block_hashes, req.num_tokens)
    assert h.tier.match(again, scope_for("a"), 0, None) == 0
    assert h.tier.match(again, scope_for("a"), 0, None) == 0  # vLLM asks again next step
    (event,) = h.tier.events
    assert event.kind is EventKind.RESTORE
    assert event.details["decision"] == "recompute"
    assert event.details["tier_hit_block_count"] == 2
    assert event.details["restore_us_estimate"] == 2000
    assert event.details["recompute_us_estimate"] == 2 * BS
    assert h.tier.stats["tier_recompute_decisions"] == 1


def test_a_measured_worker_profile_drives_the_decision() -> None:
    h = Harness(policies(a=OFFLOAD), prefill_us_per_token=1)
    h.tier.on_report(TierReport(restore_s_per_block=0.5))
    assert h.tier.restore_s_per_block == 0.5
    assert h.tier._decide(1)[0] == "recompute"
    h.tier.on_report(TierReport(restore_s_per_block=1e-6))
    assert h.tier._decide(1)[0] == "restore"


def test_a_purge_shreds_matching_domains_and_reports_its_figures() -> None:
    h = Harness(policies(a=OFFLOAD, b=OFFLOAD))
    h.finish("r1", "a", [1, 2], 2)
    h.finish("r2", "b", [3], 1)
    h.evict([1, 2, 3])
    h.worker_does()
    figures = h.tier.purge(PurgeSelector(PurgeKind.TENANT, "a"), command_id=42)
    assert figures == {"tier_key_count": 1, "tier_entry_count": 2, "tier_bytes": 2000}
    _, _, shred, _ = h.tier.take_orders()
    assert [(o.scope_tag, o.reason, o.command_id) for o in shred] == [("st_a", "purge", 42)]
    assert h.tier.index.domain_usage(scope_for("a").domain_key) == (0, 0)
    assert len(h.tier.index) == 1  # b's entry stays


def test_a_spill_ordered_before_a_purge_is_not_indexed_after_it() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.finish("r1", "a", [1], 1)
    h.evict([1])  # spill ordered ...
    h.tier.purge(PurgeSelector(PurgeKind.TENANT, "a"), command_id=1)  # ... then the purge
    h.worker_does()  # the worker spills, then shreds the domain: the entry is gone
    assert len(h.tier.index) == 0


def test_key_shred_entries_carry_the_evidence() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.finish("r1", "a", [1], 1)
    h.evict([1])
    h.worker_does()
    h.tier.events.clear()
    h.tier.purge(PurgeSelector(PurgeKind.TENANT, "a"), command_id=7)
    h.worker_does()
    (event,) = [e for e in h.tier.events if e.kind is EventKind.KEY_SHRED]
    assert event.scope_tag == "st_a"
    assert event.details == {
        "engine_id": "e1",
        "reason": "purge",
        "entry_count": 1,
        "bytes_deleted": 1000,
        "destroyed_epoch": 0,
        "command_id": 7,
    }


def test_expiry_drops_old_entries_and_shreds_an_emptied_domain() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.finish("r1", "a", [1], 1)
    h.evict([1])
    h.worker_does()
    h.tier.sweep(h.now + 50)
    assert h.tier.take_orders() == ((), (), (), ())
    h.tier.sweep(h.now + 100)
    _, drop, shred, _ = h.tier.take_orders()
    # No drop before the shred: the shred deletes the domain's ciphertexts, so its `key.shred`
    # entry counts them (a review found `entry_count: 0` after the drops had taken them).
    assert drop == () and [o.reason for o in shred] == ["expiry"]


def test_disabling_a_tenant_or_revoking_offload_shreds_at_the_policy_change() -> None:
    h = Harness(policies(a=OFFLOAD, b=OFFLOAD))
    h.finish("r1", "a", [1], 1)
    h.finish("r2", "b", [2], 1)
    h.evict([1, 2])
    h.worker_does()
    h.policy = policies(a={**OFFLOAD, "enabled": False}, b={})
    h.tier.on_policy()
    _, _, shred, _ = h.tier.take_orders()
    assert sorted((o.scope_tag, o.reason) for o in shred) == [
        ("st_a", "disable"),
        ("st_b", "policy"),
    ]
    assert len(h.tier.index) == 0


def test_the_tenant_budget_sends_drop_orders() -> None:
    h = Harness(policies(a={"offload": {"allowed": True, "max_bytes": 2000}}))
    h.finish("r1", "a", [1, 2, 3], 3)
    h.evict([1, 2, 3])
    h.worker_does()
    _, drop, _, _ = h.tier.take_orders()
    assert [o.key.position for o in drop] == [0]
    assert h.tier.index.tenant_bytes("a") == 2000


def test_prefill_cost_is_the_marginal_cost_per_token_of_the_steps() -> None:
    """Steps cost 5 ms fixed plus 80 us per token: the decision must see 80 us, not the average
    (which a small batch inflates with the fixed cost)."""
    h = Harness(policies(a=OFFLOAD))
    assert h.tier.prefill_s_per_token is None
    for tokens in [1, 64, 3, 128, 2, 96, 1, 256, 5, 32, 200]:
        h.tier._steps.append((tokens, 0.005 + 80e-6 * tokens))
    h.tier._fitted = False
    assert h.tier.prefill_s_per_token == pytest.approx(80e-6)


def test_without_a_slope_the_cheapest_prefill_sized_step_stands_in() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.tier.step_started(1)  # a decode step
    h.tier.step_finished()
    assert h.tier.prefill_s_per_token is None  # nothing prefill-sized yet
    h.tier.step_started(4 * BS)
    h.tier.step_finished()
    first = h.tier.prefill_s_per_token
    assert first is not None and first >= 0


def test_a_configured_cost_wins_over_measurement() -> None:
    h = Harness(policies(a=OFFLOAD), prefill_us_per_token=7, restore_us_per_block=9)
    h.tier.step_started(4 * BS)
    h.tier.step_finished()
    h.tier.on_report(TierReport(restore_s_per_block=1.0))
    assert h.tier.prefill_s_per_token == pytest.approx(7e-6)
    assert h.tier.restore_s_per_block == pytest.approx(9e-6)


def test_the_restore_estimate_follows_real_restores() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.tier.on_report(TierReport(restore_s_per_block=10e-6))  # the start-up profile: optimistic
    req = h.finish("r1", "a", [1, 2], 2)
    h.evict([1, 2])
    h.worker_does()
    again = FakeRequest("r2", req.block_hashes, req.num_tokens)
    h.tier.match(again, scope_for("a"), 0, None)
    h.tier.after_alloc(again, [5, 6, 7], 2 * BS)
    *_, load = h.tier.take_orders()
    h.tier.on_report(TierReport(restored=list(load), restore_s=2 * 500e-6))
    # An exponential average moves a fifth of the way from 10 us towards the 500 us measured.
    assert h.tier.restore_s_per_block == pytest.approx(10e-6 + 0.2 * 490e-6)


def test_closing_records_that_every_key_dies_with_the_process() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.finish("r1", "a", [1], 1)
    h.evict([1])
    h.worker_does()
    h.tier.events.clear()
    h.tier.closing_shreds(h.now)
    (event,) = h.tier.events
    assert event.kind is EventKind.KEY_SHRED and event.details["reason"] == "shutdown"


def test_a_purge_of_a_domain_that_never_spilled_has_nothing_to_shred() -> None:
    h = Harness(policies(a=OFFLOAD))
    h.finish("r1", "a", [1], 1)  # cached, a candidate, never evicted
    figures = h.tier.purge(PurgeSelector(PurgeKind.TENANT, "a"), command_id=3)
    assert figures == {"tier_key_count": 0, "tier_entry_count": 0, "tier_bytes": 0}
    assert h.tier.take_orders() == ((), (), (), ())
    h.evict([1])  # the purge dropped the candidate too
    assert h.tier.take_orders()[0] == ()


def test_disk_only_where_the_policy_allows_it_and_the_engine_has_a_directory() -> None:
    disk = {"offload": {"allowed": True, "disk": True}}
    h = Harness(policies(a=disk, b=OFFLOAD), directory="/var/lib/kvguard/tier")
    h.finish("r1", "a", [1], 1)
    h.finish("r2", "b", [2], 1)
    h.evict([1, 2])
    spill, *_ = h.tier.take_orders()
    assert [(o.block_id, o.to_disk) for o in spill] == [(1, True), (2, False)]
    memory_only = Harness(policies(a=disk))  # no directory: memory, whatever the policy says
    memory_only.finish("r1", "a", [1], 1)
    memory_only.evict([1])
    assert [o.to_disk for o in memory_only.tier.take_orders()[0]] == [False]


def test_a_narrowed_share_groups_domain_is_shredded_at_the_policy_change() -> None:
    """A version that stops listing a prefix retires the group's cached blocks on the device (the
    engine cannot tell which block holds which prefix); its spilled copies must go as well, or a
    member restores a delisted prefix from the tier (found while fixing the device side)."""
    member = {**OFFLOAD, "reuse": "group", "groups": ["g"]}
    listed = {"prefixes": [{"id": "p", "digest": "sha256:" + "1" * 64}]}
    group = PolicySet.model_validate(
        {"share_groups": {"g": listed}, "tenants": {"a": member, "b": OFFLOAD}}
    )
    h = Harness(group)
    hashes = [b"g-h0"]
    h.pool.blocks[1].block_hash = hashes[0] + b"\x00\x00\x00\x00"
    h.cached.add(1)
    h.tier.note_cached(FakeRequest("r1", hashes, BS + 1), scope_for("a", group="g"), [1], h.pool)
    h.finish("r2", "b", [2], 1)
    h.evict([1, 2])
    h.worker_does()
    h.tier.on_policy(frozenset({"other"}))  # another group narrowed: nothing of g goes
    assert h.tier.take_orders()[2] == ()
    h.tier.on_policy(frozenset({"g"}))
    _, _, shred, _ = h.tier.take_orders()
    assert [(o.scope_tag, o.reason) for o in shred] == [("st_a", "policy")]
