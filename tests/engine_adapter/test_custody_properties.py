"""G4 (conservation) and G2/G3 as properties: random engine behaviour, invariants after every step.

A tiny engine model drives custody the way vLLM does: new blocks come from the free queue (clean or
residue blocks first, then cached blocks in LRU order, which is an engine eviction), prefix hits take
cached blocks of the same domain, and quarantined blocks stay out of the free queue until zeroized.
Alongside custody the test keeps its own shadow of which scope's bytes each block holds, so G3 is
checked independently of custody's bookkeeping.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvguard.engine_adapter.custody import Custody
from kvguard.engine_adapter.records import BlockStatus, PurgeKind, PurgeSelector
from kvguard.policy import PolicySet, Retention, TenantPolicy, Zeroize, ZeroizeOn
from kvguard.policy.decisions import expired_at
from tests.engine_adapter.conftest import DERIVER, scope_for

N_BLOCKS = 12
TENANTS = ["a", "b", "c"]
POLICIES = PolicySet(
    tenants={
        "a": TenantPolicy(),
        "b": TenantPolicy(zeroize=Zeroize(on_release=ZeroizeOn.CROSS_SCOPE)),
        "c": TenantPolicy(retention=Retention(ttl_s=5, idle_s=3)),
    }
)


class CustodyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policies = POLICIES
        self.c = Custody(N_BLOCKS, policy=self._policy_for, tagger=DERIVER.scope_tag)
        self.now = 0.0
        self.next_rid = 0
        self.running: dict[str, list[int]] = {}
        self.bytes_of: dict[int, str | None] = dict.fromkeys(range(N_BLOCKS))  # shadow: whose data

    def _policy_for(self, tenant: str) -> TenantPolicy:
        return self.policies.policy_for(
            tenant
        )  # looked up per call: change_retention swaps the set

    def _engine_free(self) -> list[int]:
        recs = [self.c.record(b) for b in range(N_BLOCKS)]
        clean = [r.block_id for r in recs if r.status is BlockStatus.FREE]
        cached = sorted(
            (r for r in recs if r.status is BlockStatus.CACHED), key=lambda r: r.last_used_at
        )
        return clean + [r.block_id for r in cached]

    @rule(
        tenant=st.sampled_from(TENANTS),
        n=st.integers(1, 4),
        use_cache=st.booleans(),
        hit=st.booleans(),
        hashed=st.booleans(),
    )
    def start_request(self, tenant, n, use_cache, hit, hashed) -> None:
        scope = scope_for(tenant)
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self.c.begin(rid, scope, use_cache=use_cache)
        hits = []
        if hit and use_cache:
            hits = [
                b
                for b in range(N_BLOCKS)
                if self.c.record(b).status in (BlockStatus.CACHED, BlockStatus.ACTIVE)
                and self.c.record(b).hashed
                and self.c.record(b).owner.same_domain(scope)
            ][:2]
            if hits:
                self.c.reuse(rid, hits, self.now, tokens_matched=16 * len(hits))
        free = self._engine_free()[:n]
        handover = self.c.allocate(rid, free, self.now)
        plan = self.c.take_plan()
        assert set(handover) <= set(plan.handover)
        # The worker clears the plan before the forward pass writes the new owner's bytes.
        for b in plan.all_blocks:
            self.bytes_of[b] = None
        self.c.zeroized(plan.release, self.now, {"verified": True})
        self.c.zeroized(plan.handover, self.now, {"verified": True}, handover=True)
        for b in free:
            prior = self.bytes_of[b]
            # G3: the forward pass never writes into a block holding another scope's bytes.
            assert prior is None or prior == tenant, f"block {b}: {prior} bytes handed to {tenant}"
            self.bytes_of[b] = tenant
        if hashed and free:
            self.c.mark_hashed(free)
        self.running[rid] = free + hits

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[rid]
        quarantined = self.c.finish(rid, self.now)
        for b in quarantined:
            assert self.c.record(b).status is BlockStatus.QUARANTINED  # G2: out of the pool

    @rule(dt=st.floats(0.5, 4.0))
    def tick_and_sweep(self, dt) -> None:
        self.now += dt
        self.c.sweep(self.now)
        # The sweep's index against the rule itself: no cached block outlives its current policy.
        for b in range(N_BLOCKS):
            rec = self.c.record(b)
            if rec.status is BlockStatus.CACHED:
                policy = self.policies.policy_for(rec.owner.tenant_id)
                assert not expired_at(policy, rec.created_at, rec.last_used_at, self.now), b

    @rule(tenant=st.sampled_from(TENANTS), ttl=st.integers(0, 8), idle=st.integers(0, 8))
    def change_retention(self, tenant, ttl, idle) -> None:
        """A policy command: the next sweep applies the tenant's new TTL and idle limit."""
        tenants = dict(self.policies.tenants)
        old = self.policies.policy_for(tenant)
        retention = Retention(ttl_s=ttl, idle_s=min(idle, ttl))  # idle over TTL is refused
        tenants[tenant] = old.model_copy(update={"retention": retention})
        self.policies = PolicySet(tenants=tenants)

    @rule(tenant=st.sampled_from(TENANTS))
    def purge(self, tenant) -> None:
        self.c.purge(PurgeSelector(PurgeKind.TENANT, tenant), self.now)

    @rule()
    def worker_zeroizes(self) -> None:
        plan = self.c.take_plan()
        for b in plan.all_blocks:
            self.bytes_of[b] = None
        self.c.zeroized(plan.release, self.now, {"verified": True})
        self.c.zeroized(plan.handover, self.now, {"verified": True}, handover=True)

    @invariant()
    def conservation(self) -> None:
        self.c.check_invariants()  # G4
        counts = self.c.counts()
        assert sum(counts.values()) == N_BLOCKS
        held = sum(self.c.tenant_blocks(t) for t in TENANTS)
        assert (
            held
            == counts[BlockStatus.ACTIVE]
            + counts[BlockStatus.CACHED]
            + counts[BlockStatus.QUARANTINED]
        )


CustodyMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_G4_custody_conservation_under_random_engine_behaviour = CustodyMachine.TestCase
