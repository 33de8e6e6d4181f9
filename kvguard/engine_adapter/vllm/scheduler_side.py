"""The scheduler half of the vLLM connector: custody, policy, block-pool holds and the ledger.

vLLM's scheduler owns block ids and the free queue; this class keeps `Custody` in step with it and
enforces custody's answers on the pool:

- a quarantined block is *held*: `BlockPool.touch` takes it out of the free queue (or adds a reference
  while the finishing request still holds it) and its prefix hash is evicted, so nobody can allocate it
  or hit it; when the worker reports it zeroized, `BlockPool.free_blocks` returns it, unhashed;
- every step, blocks newly given to a request are checked: one that holds another domain's bytes goes
  into the step's handover list, which the worker clears before the forward pass (G3). This also
  catches frees that bypass the connector (preemption);
- prefix hits are re-checked against the request's reuse domain (defence in depth, G1).

Commands from the database (purges, policy versions) run through `engine_link.CommandRunner`; cache
statistics and heartbeats to the engine registry go through `reporting.EngineReporter`. All of this
runs in the scheduler's single thread; nothing here touches tensors.

The guard opens nothing: the connector builds the engine link (one pool, one thread), the ledger, the
salt deriver and the starting policy (`open_scheduler_guard`) and passes them in, so tests build a
guard over fakes in microseconds (tests/engine_adapter/test_scheduler_guard.py).
"""

from __future__ import annotations

import atexit
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from functools import cached_property
from itertools import compress
from typing import Any

from kvguard.audit.ledger import Ledger
from kvguard.engine_adapter.custody import Custody
from kvguard.engine_adapter.ledger_bridge import LedgerBridge, PendingEvent
from kvguard.engine_adapter.records import (
    BlockStatus,
    CustodyEvent,
    PurgeSelector,
    StepPlan,
    purge_event_kind,
)
from kvguard.engine_adapter.vllm.engine_link import CommandRunner, EngineLink
from kvguard.engine_adapter.vllm.intake import (
    UNGOVERNED_TENANT,
    confine_hashes,
    make_private,
    ungoverned_scope,
)
from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, GuardWorkerMeta
from kvguard.engine_adapter.vllm.ranks import RankMerger
from kvguard.engine_adapter.vllm.reporting import HEARTBEAT_S, EngineReporter
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.engine_adapter.vllm.tier_scheduler import SchedulerTier, TierSettings
from kvguard.engine_adapter.vllm.transport import Envelope, read_envelope
from kvguard.engine_adapter.vllm.wakeup import WAKE_CHECK_S, IdleWaker
from kvguard.errors import CustodyError, LedgerUnavailableError, ScopeError
from kvguard.isolation.salts import SaltDeriver
from kvguard.isolation.scope import Scope, Share
from kvguard.logging import get_logger
from kvguard.policy import (
    NO_USAGE,
    AuditLevel,
    Decision,
    PolicySet,
    TenantPolicy,
    Usage,
    Verify,
    admit,
    may_reuse,
    narrowed_groups,
    private_scope,
    shared_prefix_tokens,
)

_log = get_logger("vllm.scheduler")


def _repair_reason(exc: CustodyError) -> str:
    """A stable, id-free reason for the ledger (the message names block ids)."""
    text = str(exc)
    for marker, reason in (
        ("outside the request's reuse domain", "cross_domain_hit"),
        ("quarantined", "quarantined_block"),
        ("while active", "active_block_reallocated"),
    ):
        if marker in text:
            return reason
    return "inconsistent_state"


_VERIFY_RANK = {Verify.NONE: 0, Verify.SAMPLE: 1, Verify.FULL: 2}
# Tags remembered (tag -> tenant: announced, and each event's audit level) before those nothing
# refers to any more are forgotten (`_forget_idle_tags`): a session scope has a tag of its own, so
# an engine serving a conversation per session would otherwise grow this map without bound.
TAGS_KEPT = 1 << 16
_ACTIVE = BlockStatus.ACTIVE
_KEEPS_HASH = frozenset((BlockStatus.ACTIVE, BlockStatus.CACHED))  # released blocks' hashes go
__all__ = ["UNGOVERNED_TENANT", "SchedulerGuard", "open_scheduler_guard"]
SWEEP_INTERVAL_S = 0.25
_NO_ORDERS: tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]] = (
    (),
    (),
    (),
    (),
)


def open_scheduler_guard(
    options: GuardOptions, *, model_name: str, block_size: int, ranks: int = 1
) -> SchedulerGuard:
    """Open what a scheduler guard works with (the engine link, the ledger, the salt deriver, the
    starting policy, seeded into an empty store) and build the guard over them."""
    deriver = options.deriver()
    ledger = options.open_ledger()
    link = EngineLink.open(options.control_url, options.policy_url)
    try:
        policy = options.initial_policy(ledger, store=link.policies)
    except BaseException:
        link.close()
        ledger.close()
        raise
    return SchedulerGuard(
        options,
        model_name=model_name,
        block_size=block_size,
        ranks=ranks,
        link=link,
        ledger=ledger,
        deriver=deriver,
        policy=policy,
    )


class SchedulerGuard:
    """Custody and policy for one vLLM scheduler (see the module docstring)."""

    _tags_kept = 0  # tags still in use at the last `_forget_idle_tags`

    def __init__(
        self,
        options: GuardOptions,
        *,
        model_name: str,
        block_size: int,
        link: EngineLink,
        ledger: Ledger,
        deriver: SaltDeriver,
        policy: tuple[PolicySet, int | None],
        clock: Callable[[], float] = time.time,
        ranks: int = 1,
    ) -> None:
        self.options = options
        # Tensor parallel: a clear counts once every rank has reported its shard (ranks.py).
        self.ranks = RankMerger(ranks)
        self.link = link
        self.deriver = deriver
        self.ledger = ledger
        self.policies, self.policy_version = policy
        self.bridge = LedgerBridge(self.ledger, self._level_for_tag)
        self._clock = clock
        self._model_name = model_name
        self._block_size = block_size
        self._pool: Any = None
        self.custody: Custody | None = None
        self._envelopes: dict[str, Envelope] = {}
        self._live: dict[str, Any] = {}  # request objects, for the active-token count only
        self._begun: set[str] = set()
        self._held: set[int] = set()
        self._tag_tenant: dict[str, str] = {}
        self._purges: list[PurgeSelector] = []
        self._quota_wait: dict[str, tuple[Scope, int, int]] = {}  # rid -> (scope, needed, cap)
        self._deferred: set[str] = set()
        self._granted: Counter[str] = Counter()  # blocks let through this schedule, per tenant
        self._step = 0
        self._closed = False
        self._unsent: list[PendingEvent] = []  # refused by the ledger, submitted first next time
        # Requests of tenants with a quota (rid -> tenant), and the tenants among them whose
        # running work grew in this schedule (`reclaim_over_quota` after the step's allocations).
        self._quota_tenant: dict[str, str] = {}
        self._grown: set[str] = set()
        self._refused_at = -1  # the step of the last refusal
        # Whether new requests may start (`_ledger_open`), decided once a schedule (at this step)
        self._gate_step, self._gate_open = -1, True
        # Purge-doomed requests -> their blocks whose prefix hash was dropped (`_drop_doomed_hashes`)
        self._doomed_seen: dict[str, set[int]] = {}
        self.engine_id = uuid.uuid4().hex[:12]
        self.commands = CommandRunner(self.engine_id, link)
        self._commands_ready = self.commands.ready  # fetched, not run yet (read without a call)
        self.reporter = EngineReporter(
            link.registry,
            engine_id=self.engine_id,
            tenant_tag=self.deriver.tenant_tag,
            clock=clock,
        )
        # Quiet steps (`build_step`) are told apart unless the offload tier or the test canary
        # runs (each of their steps takes the full path); `_due_at`: when a quiet step must take
        # it anyway (`_set_due_at`; -inf until the first housekeeping, always without shortcuts).
        self._shortcuts = options.offload_bytes <= 0 and not options.canary
        self._last_sweep = self._due_at = float("-inf")
        # Set by the idle waker's check, cleared by the next step; the step whose figures the
        # last heartbeat took.
        self._wake_requested, self._beat_step = False, 0
        self.waker = IdleWaker.attach(
            commands=link.queue,
            last_command=lambda: self.commands.last_seq,
            cached_blocks=lambda: self.custody.cached_count if self.custody is not None else 0,
            request_wake=self._request_wake,
            figures_stale=self.figures_stale,
        )
        if self.waker is not None:  # fetched commands wake an idle engine at once
            self.commands.on_fetched = self.waker.wake
        link.every(0.0, self.commands.fetch_chore)  # every tick: new commands first,
        link.every(0.0, self.commands.flush_acks)  # then the acknowledgements of those that ran
        link.every(HEARTBEAT_S, self.reporter.keepalive)
        if self.waker is not None:
            link.every(WAKE_CHECK_S, self.waker.check)
        link.start()
        atexit.register(self.close)
        self.stats = self.reporter.stats  # engine-wide counters, reported with every heartbeat
        self.tier: SchedulerTier | None = None
        if options.offload_bytes > 0:
            self.tier = SchedulerTier(
                TierSettings(
                    options.offload_bytes,
                    options.offload_dir,
                    options.offload_restore_us_per_block,
                    options.offload_prefill_us_per_token,
                ),
                block_size=block_size,
                engine_id=self.engine_id,
                policies=lambda: self.policies,
                tag_for=self._domain_tag,
                member_tag_for=self._tag,
                clock=clock,
                stats=self.stats,
                tenant_figure=self.reporter.tier_figure,
            )

    # --- wiring ---------------------------------------------------------------------------------

    def bind_pool(self, pool: Any) -> None:
        self._pool = pool
        self.custody = Custody(len(pool.blocks), policy=self._policy_for, tagger=self._tag)
        self.reporter.register(
            model=self._model_name, block_size=self._block_size, num_blocks=len(pool.blocks)
        )

    def _policy_for(self, tenant: str) -> TenantPolicy:
        return self.policies.policy_for(tenant)  # looked up per call: policy commands swap the set

    def _tag(self, scope: Scope) -> str:
        """The tag custody's events and blocks carry for `scope`: its tenant's own
        (`SaltDeriver.member_tag`), announced to the registry (tag -> tenant: the tenant's ledger
        view) and remembered for its audit level. Ungoverned traffic's one-off scopes (one per
        request) share one tag: a tag each grew these maps, and the registry, without bound
        (found by a review); custody tells their blocks apart by scope, not by tag."""
        if scope.tenant_id == UNGOVERNED_TENANT:
            scope = self._ungoverned
        tag = self.deriver.member_tag(scope)
        if tag not in self._tag_tenant:
            self._tag_tenant[tag] = scope.tenant_id
            self.reporter.new_tag(tag, scope.tenant_id)
        return tag

    @cached_property
    def _ungoverned(self) -> Scope:
        """The one scope whose tag all ungoverned traffic's events carry (`_tag`)."""
        return ungoverned_scope(self._model_name, self._block_size, "all")

    def _domain_tag(self, scope: Scope) -> str:
        """The public pseudonym of `scope`'s reuse domain, which the offload tier binds into its
        ciphertexts and every member of a shared domain must present; a tenant or session
        scope's is its `_tag`. A group or public domain's is announced for no tenant (the tier
        records a member's spills and restores under its `_tag`; only a shared domain's key shred
        carries this one, in admins' and auditors' views)."""
        if scope.share in (Share.TENANT, Share.SESSION):
            return self._tag(scope)
        return self.deriver.scope_tag(scope)

    def _level_for_tag(self, tag: str | None) -> AuditLevel:
        tenant = self._tag_tenant.get(tag or "")
        return self.policies.policy_for(tenant).audit if tenant else AuditLevel.FULL

    @property
    def _c(self) -> Custody:
        if self.custody is None:
            raise CustodyError("the block pool was never bound to the kvguard connector")
        return self.custody

    # --- requests -------------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Decide how the request may use the cache, before the scheduler looks it up."""
        self.stats["requests"] += 1
        # Expire, purge and take policy commands first: the request's admission must see the policy
        # in force, and its prefix lookup must not hit a block that policy has already retired.
        # (Safe here: nothing is being allocated right now.)
        self._housekeeping(self._clock())
        params = getattr(request, "sampling_params", None)
        try:
            envelope = read_envelope(getattr(params, "extra_args", None))
        except ScopeError as exc:
            _log.warning("kvguard envelope refused", error=str(exc))
            envelope = None
        if envelope is None:
            self.stats["ungoverned"] += 1
            scope = ungoverned_scope(self._model_name, self._block_size, request.request_id)
            envelope = Envelope(scope=scope, use_cache=False)
        elif envelope.use_cache and (
            request.cache_salt != self.deriver.salt(envelope.scope)
            or envelope.scope.cache_config.block_size != self._block_size
        ):
            # A salt the server did not derive for this scope (forged, copied or stale), or a scope
            # that does not describe this engine's cache: no prefix caching (G1).
            self.stats["untrusted_salts"] += 1
            _log.warning(
                "untrusted cache salt; prefix caching disabled for the request",
                scope_tag=self._tag(envelope.scope),
            )
            envelope = Envelope(scope=envelope.scope, use_cache=False)
        decision = self._admit_quota(request, envelope.scope)
        if not (envelope.use_cache and decision.use_cache):
            # No cache: the blocks' owner is private to the tenant (`private_scope`).
            envelope = Envelope(scope=private_scope(envelope.scope), use_cache=False)
        elif decision.scope not in (None, envelope.scope):
            # This engine's policy narrows what the front end admitted (the front end follows
            # policy versions up to a second later): run under the narrowed scope, whose salt
            # and block hashes are recomputed here, never under the one the request asked for.
            envelope = self._narrowed(request, decision.scope)
        if envelope.use_cache and envelope.scope.share is Share.GROUP:
            envelope = self._group_prefix(request, envelope)
        if not envelope.use_cache:
            make_private(request, skip_reading=request.request_id not in self._quota_wait)
        self._rescope_quota_wait(request.request_id, envelope.scope)
        self._envelopes[request.request_id] = envelope
        self._live[request.request_id] = request
        self.reporter.prompt(envelope.scope.tenant_id, int(request.num_prompt_tokens))

    def _group_prefix(self, request: Any, envelope: Envelope) -> Envelope:
        """A share group shares only the prefixes it lists, from `min_shared_tokens` on (docs/policy.md).
        The request keeps the group scope for the listed prefix it starts with, and only those
        blocks stay cached for the group; a prompt starting with no listed prefix runs under its
        tenant's own scope (salt and block hashes recomputed), as if it had not asked to share."""
        scope = envelope.scope
        ids = list(getattr(request, "prompt_token_ids", None) or ())
        shared = shared_prefix_tokens(self.policies, scope.group_id or "", ids, self._block_size)
        own = scope.with_share(Share.TENANT)
        if shared >= self._block_size:
            # Past the listed prefix the blocks are the tenant's alone: hashed with its own
            # secret, so no other member hits them while this request runs (found by a review).
            key = self.deriver.salt(own).encode()
            confine_hashes(request, shared // self._block_size, key)
            return Envelope(scope=scope, use_cache=True, share_tokens=shared)
        return self._narrowed(request, own)

    def _narrowed(self, request: Any, own: Scope) -> Envelope:
        """The request under `own`, a narrower scope than it asked for: the salt and block hashes
        it arrived with were derived for the wider one."""
        self.stats["share_narrowed"] += 1
        request.cache_salt = self.deriver.salt(own)
        request.block_hashes = []
        request.update_block_hashes()
        return Envelope(scope=own, use_cache=True)

    def _admit_quota(self, request: Any, scope: Scope) -> Decision:
        """Admission with the tenant's holdings and the blocks this request needs (prompt plus
        `max_tokens`). Over quota on its cached blocks: run without caching. Every request of a
        tenant with a quota is then held to it when vLLM schedules it (`may_schedule`)."""
        tenant = scope.tenant_id
        cap = self.policies.policy_for(tenant).quota.max_blocks
        if cap is None:
            return admit(self.policies, scope, NO_USAGE)
        needed = self._blocks_needed(request)
        self._wait_for_quota(request.request_id, scope, needed, cap)
        cached = self._c.tenant_cached(tenant)
        # Running work is held by `may_schedule`; here only the cache decides (no growth past it).
        return admit(self.policies, scope, Usage(blocks_cached=cached, blocks_requested=needed))

    def _wait_for_quota(self, rid: str, scope: Scope, needed: int, cap: int) -> None:
        """`may_schedule` holds the request to its tenant's quota (`cap` blocks) until granted."""
        self._quota_wait[rid] = (scope, needed, cap)
        self._quota_tenant[rid] = scope.tenant_id

    def _rescope_quota_wait(self, rid: str, scope: Scope) -> None:
        """A waiting request runs under `scope` now: its deferral names that scope (G5)."""
        waiting = self._quota_wait.get(rid)
        if waiting is not None and waiting[0] is not scope:
            self._quota_wait[rid] = (scope, *waiting[1:])

    def _blocks_needed(self, request: Any) -> int:
        """The blocks a request needs at most: its prompt plus `max_tokens`."""
        params = getattr(request, "sampling_params", None)
        max_tokens = int(getattr(params, "max_tokens", None) or 0)
        return -(-(int(request.num_prompt_tokens) + max_tokens) // self._block_size)

    def _quota_again(self, rid: str) -> None:
        """A preempted request waits for its tenant's quota again before it resumes: it gave its
        blocks back, and `may_schedule` had let it through once (found by a review: a preempted
        request of a tenant with a quota resumed unchecked). The quota is the one in force now."""
        env, request = self._envelopes.get(rid), self._live.get(rid)
        if env is None or request is None:
            return
        tenant = env.scope.tenant_id
        cap = self.policies.policy_for(tenant).quota.max_blocks
        if cap is None:
            return
        self._wait_for_quota(rid, env.scope, self._blocks_needed(request), cap)
        # vLLM schedules a request that skips reading the prefix cache whatever the connector
        # answers, so the gate needs reading on; a request without the cache has a one-off salt
        # (`make_private`) and hits nothing either way (found by a review).
        request.skip_reading_prefix_cache = False

    def _requota(self, rid: str) -> None:
        """A request that has not started waits for the quota of the version in force now: a
        lowered or new quota holds it, a lifted one lets it go (found by a review: a queued
        request kept the cap of its admission, and one admitted without a quota ran past a quota
        that appeared while it waited)."""
        env = self._envelopes.get(rid)
        policy = self.policies.policy_for(env.scope.tenant_id) if env is not None else None
        if policy is not None and policy.quota.max_blocks is not None:
            self._quota_again(rid)
        elif self._quota_wait.pop(rid, None) is not None:
            self._quota_tenant.pop(rid, None)
            self._deferred.discard(rid)

    def may_schedule(self, request: Any) -> bool:
        """False while running this request would take its tenant past its quota: vLLM leaves it
        waiting and schedules other tenants' requests past it, so a tenant's flood holds at most its
        quota of the pool. A request larger than the whole quota runs when the tenant has nothing
        else running. The first deferral of a request is a `quota.defer` ledger entry."""
        # While the ledger refuses entries (G7) nothing new starts unrecorded; running work goes on.
        if request.request_id not in self._begun and not self._ledger_open():
            return False
        waiting = self._quota_wait.get(request.request_id)
        if waiting is None:
            return True
        scope, needed, cap = waiting
        tenant = scope.tenant_id
        busy = self._c.tenant_active(tenant) + self._granted[tenant]
        if busy and busy + needed > cap:
            if request.request_id not in self._deferred:
                self._deferred.add(request.request_id)
                self.stats["quota_deferred"] += 1
                self._c.quota_deferred(
                    request.request_id, scope, self._clock(), blocks_requested=needed, cap=cap
                )
            return False
        del self._quota_wait[request.request_id]
        self._deferred.discard(request.request_id)
        self._granted[tenant] += needed  # until build_step records this step's allocations
        return True

    def _ledger_open(self) -> bool:
        """Whether the ledger takes entries now: asked before a request starts, once a schedule
        (not once per waiting request). Events it refused are submitted again; with none waiting
        it is probed. Without the probe an outage that began since the last submission went
        unseen until this step's own events were refused in `build_step`, after vLLM had started
        every queued request (found by a re-test: tests/engine_adapter/test_engine_races.py)."""
        if self._gate_step == self._step:
            return self._gate_open
        self._gate_step = self._step
        if self._unsent:
            self._forward([])
            self._gate_open = not self._unsent
        elif self._probe_refuses():
            if self._gate_open:
                _log.error("audit ledger refusing entries; new requests wait (G7)")
            if self._refused_at != self._step:
                self._refused_at = self._step
                self.stats["ledger_refusals"] += 1
            self._gate_open = False
        else:
            self._gate_open = True
        return self._gate_open

    def _probe_refuses(self) -> bool:
        """Whether the ledger would refuse an entry now (asked without queueing anything), under
        either `ledger_overflow`: the step loop never waits for room, and each tenant's
        `on_ledger_unavailable` decides what happens to its new requests meanwhile (under
        `block` a `fail_closed` tenant was admitted and then hung, found by a review)."""
        try:
            self.bridge.probe()
        except LedgerUnavailableError:
            return True
        return False

    def request_finished(self, request: Any) -> None:
        """The request is done: quarantine what policy releases, keep what it retains."""
        rid = request.request_id
        self._quota_wait.pop(rid, None)
        self._quota_tenant.pop(rid, None)
        self._deferred.discard(rid)
        if self.tier is not None:
            self.tier.forget_request(rid)
        if rid not in self._begun:
            self._c.forget(rid)  # it ended while preempted
            self._envelopes.pop(rid, None)
            self._live.pop(rid, None)
            return
        self._end(rid, self._clock())
        self._envelopes.pop(rid, None)
        self._live.pop(rid, None)

    def _end(self, rid: str, now: float, *, hold: bool = True) -> None:
        """`hold` False: a preemption (the request may resume; the engine already freed its
        blocks and may re-allocate some in this schedule, so they are held after it)."""
        c = self._c
        held_by, records = c.request_blocks(rid), c.records
        self._mark_hashed([b for b in held_by if records[b].status is _ACTIVE])
        c.finish(rid, now, preempted=not hold)
        self._doomed_seen.pop(rid, None)
        self._begun.discard(rid)
        if self.tier is not None:
            self.tier.forget_request(rid)
            cached = [b for b in held_by if records[b].status is BlockStatus.CACHED]
            env = self._envelopes.get(rid)
            if cached and env is not None:
                self.tier.note_cached(
                    self._live.get(rid), env.scope, cached, self._pool, self._life
                )
        for b in held_by:
            if records[b].status not in _KEEPS_HASH:
                self._evict_hash(b)
        if hold:
            self._hold_quarantined()

    # --- steps ----------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Engine steps built so far (quiet ones included)."""
        return self._step

    def build_step(self, so: Any) -> GuardStepMeta:
        """Bring custody up to date with this step's schedule and say what the worker must clear.

        Most decode steps have nothing for kvguard to do: no request starts, resumes, is
        preempted or gets a block, custody has nothing to plan or record, and no housekeeping is
        due. Those are told apart here, with O(1) checks and one C-level pass over the running
        requests' new blocks, and get one shared empty plan (the full path would build the same
        empty plan). Inline, with one call: in the engine's step kvguard's code runs cache-cold,
        and what a step costs is mostly the functions and objects it touches, not what it
        computes (docs/benchmarks.md, issue 14 item 7)."""
        now = self._clock()
        self._step += 1
        cached = so.scheduled_cached_reqs
        c = self.custody
        if not (
            now >= self._due_at  # a sweep or heartbeat due; every step without `_shortcuts`
            or so.scheduled_new_reqs
            or so.preempted_req_ids
            or cached.resumed_req_ids
            or any(cached.new_block_ids)
            or self._granted
            or self._grown
            or self._purges
            or self._unsent
            or self._wake_requested
            or self._commands_ready
            or c is None
            or not c.settled
        ):
            return self._quiet_meta
        return self._build_step(so, now)  # its housekeeping sets `_due_at` again

    def _build_step(self, so: Any, now: float) -> GuardStepMeta:
        c = self._c
        if self.tier is not None:
            self.tier.step_started(int(so.total_num_scheduled_tokens))
        for rid in so.preempted_req_ids or ():
            self.stats["preemptions"] += 1
            if rid in self._begun:
                # The engine already freed these blocks and may have re-allocated some of them in
                # this very schedule; hold what is left only after the allocations below.
                self._end(rid, now, hold=False)
                # It resumes under the policy in force now, not the one it was admitted under,
                # and waits for its tenant's quota again (first: a request the recheck makes
                # private may still read nothing only while the quota gate can hold it back).
                self._quota_again(rid)
                self._recheck(rid)
        canary = self._record_schedule(so, now)
        self._granted.clear()  # what may_schedule let through is in custody now
        if self._grown:  # tenants whose running work grew: their own cache yields to the quota
            for tenant in self._grown:
                c.reclaim_over_quota(tenant, now)
            self._grown.clear()
        # After the allocations: a cached block the engine just re-assigned is active by now.
        self._housekeeping(now)
        self._wake_requested = False
        plan = c.take_plan()
        if plan:  # the clears the worker's verdicts will answer (any other verdict is ignored)
            self.ranks.expect(self._step, handover=plan.handover, release=plan.release)
        self._forward(c.take_events())
        if self.options.canary:
            c.check_invariants()  # test-only: G4 after every step (walks the whole pool)
        spill, drop, shred, load = self.tier.take_orders() if self.tier is not None else _NO_ORDERS
        return GuardStepMeta(
            step=self._step,
            release=plan.release,
            handover=plan.handover,
            verify=self._verify_mode(plan),
            canary=tuple(sorted(set(canary))) if self.options.canary else (),
            spill=spill,
            drop=drop,
            shred=shred,
            load=load,
        )

    @cached_property
    def _quiet_verify(self) -> str:
        """The verify mode of a step with no clears (quiet steps build no plan)."""
        return self.options.verify_override or Verify.NONE.value

    @cached_property
    def _quiet_meta(self) -> GuardStepMeta:
        """What every quiet step hands the worker: nothing to clear, one shared message (its step
        number only ever tags clears, and it orders none). Never changed once built."""
        return GuardStepMeta(step=0, verify=self._quiet_verify)

    def _record_schedule(self, so: Any, now: float) -> list[int]:
        """Record the step's allocations, then its prefix hits; returns blocks entering a new domain.

        All fresh blocks first: a request may hit blocks that another request of the same scope got
        in this very schedule (vLLM hashes full blocks when it schedules them), so its hits are only
        known to custody once every allocation of the step is. Running, resumed and new requests
        come in any order in vLLM's scheduler output; this order does not depend on it."""
        # (rid, hits, fresh, tokens matched, index of the first fresh block in the request's table:
        # known for new and resumed requests, None for running ones, whose table custody holds)
        work: list[tuple[str, list[int], list[int], int, int | None]] = []
        for new in so.scheduled_new_reqs:
            work.append(self._split(new.req_id, list(new.block_ids[0]), new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        if resumed:
            for i, rid in enumerate(cached.req_ids):
                if rid in resumed:
                    ids = cached.new_block_ids[i]
                    blocks = list(ids[0]) if ids else []
                    work.append(self._split(rid, blocks, cached.num_computed_tokens[i]))
        # Running requests that got blocks this step: on most decode steps none did, and vLLM gives
        # the others None, so this is a C-level filter over the batch, not a Python loop.
        got = cached.new_block_ids
        grown = [
            (rid, list(ids[0]))
            for rid, ids in compress(zip(cached.req_ids, got, strict=True), got)
            if ids[0] and rid not in resumed
        ]
        if not work and not grown:
            return []
        canary: list[int] = []
        # A step that only grows running requests (most steps that allocate, in steady decoding)
        # records them in one custody call; otherwise request by request, after the new ones.
        if grown and (work or not self._grow(grown, now)):
            work += [(rid, [], fresh, 0, None) for rid, fresh in grown]
        for rid, _hits, fresh, _n, start in work:
            try:
                canary += self._allocate(rid, fresh, now, start)
            except CustodyError as exc:
                canary += self._repair(rid, fresh, now, exc)
        for rid, hits, _fresh, matched, _start in work:
            if hits:
                try:
                    self._reuse(rid, hits, matched, now)
                except CustodyError as exc:
                    canary += self._repair(rid, hits, now, exc)
        return canary

    def _grow(self, grown: list[tuple[str, list[int]]], now: float) -> bool:
        """The running requests' new blocks of this step, recorded in one custody call (a decode
        step gives each request that crossed a block boundary one block: up to the batch size of
        them). False, with nothing recorded, when custody refuses the whole (the caller then goes
        request by request and repairs the one at fault) or when per-request work is needed (the
        test canary, the offload tier)."""
        if self.options.canary or self.tier is not None:
            return False
        fresh = [b for _, ids in grown for b in ids]
        if self._held:  # the engine took a block back (e.g. freed by preemption)
            self._held.difference_update(fresh)
        try:
            self._c.allocate_many(grown, now)
        except CustodyError:
            return False
        self._mark_hashed(fresh)
        if self._quota_tenant:
            quota = self._quota_tenant
            self._grown.update(quota[rid] for rid, _ in grown if rid in quota)
        return True

    def _split(
        self, rid: str, block_ids: list[int], num_computed: int
    ) -> tuple[str, list[int], list[int], int, int | None]:
        """Register a (new or resumed) request and split its blocks into prefix hits and fresh ones."""
        env = self._envelopes.get(rid)
        if env is None:
            # Not seen by on_new_request: govern it as ungoverned traffic rather than stop the engine.
            self.stats["custody_repairs"] += 1
            _log.error("request scheduled without on_new_request; treated as ungoverned")
            scope = ungoverned_scope(self._model_name, self._block_size, rid)
            env = self._envelopes[rid] = Envelope(scope=scope, use_cache=False)
        if rid not in self._begun:
            limit = None if env.share_tokens is None else env.share_tokens // self._block_size
            self._c.begin(rid, env.scope, use_cache=env.use_cache, retain_blocks=limit)
            self._begun.add(rid)
        # Tokens loaded from the offload tier are computed, but in freshly allocated blocks.
        external = self.tier.take_external(rid) if self.tier is not None else 0
        n_hit = (num_computed - external) // self._block_size if env.use_cache else 0
        hits = block_ids[:n_hit]
        return rid, hits, block_ids[n_hit:], num_computed, len(hits)

    def _reuse(self, rid: str, hits: list[int], num_computed: int, now: float) -> None:
        c, env = self._c, self._envelopes[rid]
        # A block that became full (and hashed by vLLM) after custody saw it allocated is hashed
        # now (ids the engine gave: out of range, custody's `reuse` refuses them, and repairs).
        records, n = c.records, c.num_blocks
        self._mark_hashed([b for b in hits if 0 <= b < n and records[b].status is _ACTIVE])
        # Raises CustodyError on a cross-domain hit; `_repair` takes over (G1).
        c.reuse(rid, hits, now, tokens_matched=num_computed)
        self.stats["reused_tokens"] += num_computed
        self.reporter.prefix_hit(env.scope.tenant_id, num_computed)

    def _repair(self, rid: str, blocks: list[int], now: float, exc: CustodyError) -> list[int]:
        """Custody could not account for what the engine did (`exc`): repair instead of stopping
        the engine. The request takes the blocks, those holding another domain's (or unknown)
        bytes are cleared before the forward pass, and a `custody.repair` event says so."""
        self.stats["custody_repairs"] += 1
        _log.error("custody repaired; request computes on cleared blocks", error=str(exc))
        self._c.seize(rid, blocks, now, reason=_repair_reason(exc))
        for b in blocks:
            block = self._pool.blocks[b]
            if b in self._held:  # kvguard's own hold: the request's reference replaces it
                self._held.discard(b)
                if block.ref_cnt > 1:
                    block.ref_cnt -= 1
            self._evict_hash(b)
        return list(blocks)

    def _allocate(
        self, rid: str, block_ids: list[int], now: float, start: int | None = None
    ) -> list[int]:
        scope = self._envelopes[rid].scope
        # Test-only canary: every block entering another domain must read all-zero before the forward.
        entering = (
            [b for b in block_ids if not self._same_owner(b, scope)] if self.options.canary else []
        )
        if self._held:  # the engine took a block back (e.g. freed by preemption)
            self._held.difference_update(block_ids)
        if self.tier is not None:  # cached blocks vLLM's LRU gave away: spilled before the clears
            self.tier.on_allocated(block_ids, self._is_cached)
        self._c.allocate(rid, block_ids, now, start=start)
        if self.tier is not None and self.tier.born:  # restored blocks keep their first age
            for b in block_ids:
                born = self.tier.born.pop(b, None)
                if born is not None:
                    self._c.backdate(b, born)
        self._mark_hashed(block_ids)
        if rid in self._quota_tenant:
            self._grown.add(self._quota_tenant[rid])
        return entering

    def _life(self, block_id: int) -> tuple[float, float]:
        rec = self._c.record(block_id)
        return rec.created_at, rec.last_used_at

    def _is_cached(self, block_id: int) -> bool:
        return self._c.record(block_id).status is BlockStatus.CACHED

    def _same_owner(self, block_id: int, scope: Scope) -> bool:
        owner = self._c.record(block_id).owner
        return owner is not None and owner.same_domain(scope)

    def _mark_hashed(self, block_ids: Iterable[int]) -> None:
        hashed = [b for b in block_ids if self._pool.blocks[b].block_hash is not None]
        if hashed:
            self._c.mark_hashed(hashed)
            if self._c.has_doomed:
                self._drop_doomed_hashes(scan=False)

    def _drop_doomed_hashes(self, *, scan: bool = True) -> None:
        """Take the prefix hashes of blocks a purge doomed out of vLLM's index, so no request can
        hit KV computed over a purged context: blocks the purge found active, and (`scan`, once a
        step) those that running doomed requests filled since: vLLM hashes a full block as it
        schedules it, in block-table order, so each request is scanned from the first of its
        blocks not yet seen hashed, amortised O(1) per request and step. A hit that slips through
        within one schedule is refused by custody and repaired (the block is cleared first)."""
        c, blocks = self._c, self._pool.blocks
        for b in c.take_unhash():
            if blocks[b].block_hash is not None:
                self._evict_hash(b)
                for holder in c.record(b).holders:  # full and dropped: the scan goes past it
                    self._doomed_seen.setdefault(holder, set()).add(b)
        if not scan:
            return
        for rid, held in c.doomed_requests():
            seen = self._doomed_seen.setdefault(rid, set())
            for b in held:
                if b in seen:
                    continue
                if not c.record(b).doomed:
                    # Another owner's block the request reuses (a share group's prefix): the
                    # purge did not select its owner, so it stays reusable for that owner.
                    seen.add(b)
                    continue
                if blocks[b].block_hash is None:
                    break  # not full yet: the blocks after it cannot be hashed before it is
                self._evict_hash(b)
                seen.add(b)

    def _verify_mode(self, plan: StepPlan) -> str:
        if not plan or self.options.verify_override:
            return self._quiet_verify  # no block sets to build
        best = Verify.NONE
        for b in plan.all_blocks:
            owner = self._c.record(b).owner
            mode = (
                self.policies.policy_for(owner.tenant_id).zeroize.verify if owner else Verify.SAMPLE
            )
            best = max(best, mode, key=_VERIFY_RANK.__getitem__)
        return best.value

    def _housekeeping(self, now: float) -> None:
        c = self._c
        # Expiry has a granularity of SWEEP_INTERVAL_S: walking every cached block on every request
        # and step would cost more than the engine's own scheduling on small models.
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            c.sweep(now)
            if self.tier is not None:
                self.tier.sweep(now)
            self._last_sweep = now
        if self.commands.due():  # fetched by the link thread: no database access here
            self.stats["commands"] += self.commands.run(now, self)
        while self._purges:
            selector = self._purges.pop(0)
            c.purge(selector, now, details={**self._tier_purge(selector, None)})
        if c.has_doomed:
            self._drop_doomed_hashes()
        self._hold_quarantined()
        if self.reporter.due(now):  # figures taken here, written on the link's thread
            self.beat_soon(now)
        self._set_due_at()

    def beat_soon(self, now: float | None = None) -> None:
        """Take the figures now (scheduler thread) and have the link's thread write them."""
        now = self._clock() if now is None else now
        self._beat_step = self._step
        self.reporter.heartbeat_soon(now, self._c.summary(), self._counters(), self.link.call_soon)

    def figures_changed(self) -> bool:
        """Whether steps ran since the figures were last taken."""
        return self._step != self._beat_step

    def figures_stale(self) -> bool:
        """Whether figures changed and a heartbeat is due (read on the link's thread by the idle
        waker: plain reads, a late answer costs one more check)."""
        return self.figures_changed() and self.reporter.due(self._clock())

    # --- commands and reporting ---------------------------------------------------------------

    def purge_for_command(
        self, selector: PurgeSelector, now: float, command_id: int
    ) -> dict[str, int]:
        quarantined = self._c.purge(
            selector,
            now,
            details={
                "command_id": command_id,
                "engine_id": self.engine_id,
                **self._tier_purge(selector, command_id),
            },
        )
        events = self._c.take_events()
        doomed = sum(
            int(e.details.get("blocks_active_doomed") or 0)
            for e in events
            if e.kind is purge_event_kind(selector)
        )
        # A refusal keeps the events (recorded once the ledger takes entries again); raising here
        # would stop vLLM's engine core, and running the purge again would record it twice.
        self._forward(events)
        return {"blocks_quarantined": len(quarantined), "blocks_active_doomed": doomed}

    def use_policy(self, policies: PolicySet, version: int) -> None:
        """Put a new policy version in force (a `policy` command, on the scheduler thread between
        steps). What it no longer allows stops at once: cached blocks whose owner scope it no
        longer lets share (a bumped epoch, a tenant disabled or withdrawn from its share group)
        are zeroized, and requests admitted under the old version that have not started read no
        prefix cache (found by a review: a queued request of a disabled tenant hit its old
        blocks, and a group kept serving a withdrawn member's blocks)."""
        # A share group that no longer lists a prefix it did (or asks for more shared tokens):
        # custody cannot tell which of its cached blocks hold which prefix, so all of them go, on
        # the device and in the offload tier (found by a review: a delisted prefix's blocks stayed
        # hittable for the group).
        narrowed = narrowed_groups(self.policies, policies)
        self.policies, self.policy_version = policies, version
        if self.tier is not None:
            self.tier.on_policy(narrowed)
        if self.custody is None:
            return
        now = self._clock()

        def shareable(owner: Scope) -> bool:
            if owner.share is Share.GROUP and owner.group_id in narrowed:
                return False
            return may_reuse(policies, owner, owner)

        self._c.retire_unshareable(shareable, now)
        for tenant in self._c.cached_tenants():  # a lowered quota reclaims its cache at once
            self._c.reclaim_over_quota(tenant, now)
        self._last_sweep = self._due_at = float("-inf")  # a shorter retention: at the next step
        for rid in list(self._envelopes):
            if rid not in self._begun:  # a running request is checked again if it is preempted
                self._recheck(rid)
                self._requota(rid)
        self._hold_quarantined()
        self._forward(self._c.take_events())

    def _recheck(self, rid: str) -> None:
        """A request that has not started (queued, or preempted and about to resume) under a
        policy version newer than its admission: if that version no longer lets its scope use the
        cache (a tenant disabled or withdrawn from its group, a lower `reuse`, a delisted group
        prefix), it reads and keeps nothing cached from then on, under a private scope."""
        env = self._envelopes.get(rid)
        if env is None or not env.use_cache:
            return
        policies, scope = self.policies, env.scope
        decision = admit(policies, scope, NO_USAGE)
        allowed = decision.use_cache and may_reuse(policies, scope, scope)
        request = self._live.get(rid)
        if allowed and scope.share is Share.GROUP and env.share_tokens:
            ids = list(getattr(request, "prompt_token_ids", None) or ())
            listed = shared_prefix_tokens(policies, scope.group_id or "", ids, self._block_size)
            allowed = listed >= env.share_tokens
        if allowed:
            return
        if request is not None:
            make_private(request, skip_reading=rid not in self._quota_wait)
        private = self._envelopes[rid] = Envelope(scope=private_scope(scope), use_cache=False)
        self._rescope_quota_wait(rid, private.scope)

    def _tier_purge(self, selector: PurgeSelector, command_id: int | None) -> dict[str, int]:
        """Crypto-shred the offload tier's domains the purge selects (the purge entry's figures)."""
        return self.tier.purge(selector, command_id) if self.tier is not None else {}

    # --- offload tier (issue 15) ------------------------------------------------------------------

    def tier_match(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens the request may load from the offload tier (vLLM's `get_num_new_matched_tokens`)."""
        env = self._envelopes.get(request.request_id)
        if self.tier is None or env is None or not env.use_cache:
            return 0
        return self.tier.match(request, env.scope, num_computed_tokens, env.share_tokens)

    def tier_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.tier is None:
            return
        ids = list(blocks.get_block_ids()[0]) if num_external_tokens > 0 else []
        self.tier.after_alloc(request, ids, num_external_tokens)

    def _counters(self) -> dict[str, int | float]:
        version = {} if self.policy_version is None else {"policy_version": self.policy_version}
        active = sum(int(getattr(r, "num_computed_tokens", 0) or 0) for r in self._live.values())
        tier = {"tier_bytes": self.tier.index.used} if self.tier is not None else {}
        return {
            "ledger_submitted": self.bridge.submitted,
            "active_tokens": active,
            **version,
            **tier,
        }

    def _forward(self, events: list[CustodyEvent]) -> None:
        """Hand custody's events to the ledger. When the ledger refuses them (its queue is full
        under `fail_closed`, G7), they are kept, in order, and submitted before anything newer at
        the next call: what already happened (blocks cleared and returned to the pool, a step's
        plan handed to the worker) is recorded late, never lost, and the engine keeps stepping.
        While events wait, no new request starts (`may_schedule`, `ledger_refusing`)."""
        if self.tier is not None and self.tier.events:
            events = [*events, *self.tier.events]
            self.tier.events.clear()
        ages = self._c.take_cache_ages()
        if not events and not ages and not self._unsent:
            return  # most decode steps
        self.reporter.observe(events)
        self.reporter.cache_ages(ages)
        selected = self.bridge.select(events)  # by the audit levels in force now, once
        if len(self._tag_tenant) > max(TAGS_KEPT, 2 * self._tags_kept):  # all selected now
            self._forget_idle_tags()
        batch = [*self._unsent, *selected] if self._unsent else selected
        try:
            self.bridge.submit(batch)
        except LedgerUnavailableError:
            if not self._unsent:
                _log.error("audit ledger refusing entries; new requests wait (G7)")
            self._unsent = batch
            if self._refused_at != self._step:  # counted once a step
                self._refused_at = self._step
                self.stats["ledger_refusals"] += 1
            return
        if self._unsent:
            _log.info("audit ledger taking entries again", recorded_late=len(self._unsent))
            self._unsent = []

    def _forget_idle_tags(self) -> None:
        """Keep only the tags custody still refers to (running requests, blocks' owners, pending
        handover clears); called once every event made so far has been selected, so no event
        waits for the level of a forgotten tag. One that comes back is announced again (the
        registry ignores a repeat). O(pool), once per `TAGS_KEPT` new tags at most (found by a
        review: a tag per session scope grew the map without bound)."""
        live = self._c.tags_in_use()
        self._tag_tenant = {t: n for t, n in self._tag_tenant.items() if t in live}
        self._tags_kept = len(self._tag_tenant)

    @property
    def ledger_refusing(self) -> bool:
        """True while custody events wait because the ledger refused them (G7: no new work)."""
        return bool(self._unsent)

    def refuses_new_work(self) -> bool:
        """Whether a request admitted now would wait for the ledger (G7): events it refused still
        wait, or, under `fail_closed`, it would refuse an entry now (asked without queueing
        anything, as `may_schedule` asks before a request starts). An in-process engine's
        admission asks this, so a `fail_closed` tenant is refused at once also when the outage
        began while the engine was idle and none of its own events was refused yet (its request
        was admitted and then waited in vLLM's queue for the whole outage)."""
        return bool(self._unsent) or self._probe_refuses()

    def report_now(self) -> bool:
        """Write a heartbeat now (scheduler thread, or the caller's with an in-process engine)."""
        written = self.reporter.heartbeat(self._clock(), self._c.summary(), self._counters())
        self._set_due_at()
        return written

    def _set_due_at(self) -> None:
        """When a quiet step must take the full path for the next sweep or heartbeat: set each
        time either may have run (housekeeping in a step or between steps, `report_now`), so it
        follows their times also when the wall clock steps back (found by a review: a lowered
        time kept only until the next full step let quiet steps skip expiry)."""
        if self._shortcuts:
            self._due_at = min(self._last_sweep + SWEEP_INTERVAL_S, self.reporter.next_beat_at)

    # --- pool holds -----------------------------------------------------------------------------

    def _hold_quarantined(self) -> None:
        for b in self._c.take_new_pending():
            if b not in self._held:
                block = self._pool.blocks[b]
                self._evict_hash(b)
                self._pool.touch([block])  # out of the free queue, or one more reference
                self._held.add(b)

    def _evict_hash(self, block_id: int) -> None:
        block = self._pool.blocks[block_id]
        if block.block_hash is not None:
            self._pool._maybe_evict_cached_block(block)

    def on_worker_output(self, worker_meta: Any) -> None:
        """The worker cleared blocks: release held ones, record the evidence."""
        if self.tier is not None:
            self.tier.step_finished()
            if isinstance(worker_meta, GuardWorkerMeta) and worker_meta.tier is not None:
                self.tier.on_report(worker_meta.tier)
                self._forward([])
        if not isinstance(worker_meta, GuardWorkerMeta):
            return
        c, now = self._c, self._clock()
        ignored = self.ranks.ignored
        merged = self.ranks.add(worker_meta.results)
        # A verdict delivered twice, or naming a clear no step planned, frees nothing (found by a
        # review: one delivered twice freed its block's next owner's bytes uncleared).
        self.stats["custody_repairs"] += self.ranks.ignored - ignored
        for result in merged:
            if not result.ok:
                # Only release clears report failures (a failed handover clear raises in the worker).
                self.stats["zeroize_failures"] += 1
                _log.error(
                    "zeroization failed; blocks stay quarantined", block_count=len(result.blocks)
                )
                c.requeue(result.blocks)
                continue
            blocks = result.blocks
            if not result.handover:
                # A verdict can arrive steps after its clear (GPU): skip blocks the engine has
                # taken back through a repair since (their evidence is the repair's clear).
                blocks = tuple(c.current_release_results(result.blocks))
                if len(blocks) < len(result.blocks):  # part of a repair, counted there
                    _log.info(
                        "late clear results of repaired blocks skipped",
                        blocks=len(result.blocks) - len(blocks),
                    )
                if not blocks:
                    continue
            self.reporter.zeroized(c, blocks, result.details, handover=result.handover, now=now)
            c.zeroized(
                blocks,
                now,
                {**dict(result.details), "engine_id": self.engine_id},
                handover=result.handover,
            )
            self.stats["blocks_zeroized"] += len(blocks)
            if result.handover:
                continue
            release = [self._pool.blocks[b] for b in blocks if b in self._held]
            self._held.difference_update(blocks)
            if release:
                self._pool.free_blocks(release)
        self._forward(c.take_events())

    def has_pending(self, *, ledger: bool = True) -> bool:
        """True while blocks wait for zeroization (keeps the engine loop stepping), and (`ledger`)
        while custody events wait for the ledger: asked, it retries the ledger first, and an idle
        engine goes on stepping (each step retries), so what the ledger refused is recorded once it
        is back, not only when the next request arrives."""
        if ledger and self._unsent:
            self._retry_ledger()
            if self._unsent:
                return True
        if self._wake_requested:  # the idle waker saw a new command or blocks that may expire
            return True
        if self.tier is not None and self.tier.has_orders():
            return True
        return bool(self._held) or bool(self._purges) or self._c.has_pending_plan()

    def _request_wake(self) -> None:
        self._wake_requested = True

    def request_purge(self, selector: PurgeSelector) -> None:
        """Queue a purge; it takes effect at the next request arrival or engine step."""
        self._purges.append(selector)

    def _retry_ledger(self) -> None:
        """Submit the events the ledger refused again, now."""
        if self._unsent:
            self._forward([])

    def poll(self) -> None:
        """Run the housekeeping that is due (expiry at most every SWEEP_INTERVAL_S; commands fetched
        here, in this thread, at most every poll interval or on NOTIFY, and acknowledged). Only from
        the scheduler's thread between steps (an in-process engine between batches)."""
        now = self._clock()
        self.stats["commands"] += self.commands.poll(now, self)
        self._retry_ledger()  # an in-process engine admits right after this
        self._housekeeping(now)

    def apply_now(self) -> None:
        """Run expiry and queued purges now, and the commands due (read here at most once a
        second, or at once on NOTIFY). Only from the scheduler's thread between steps."""
        self._last_sweep = float("-inf")
        now = self._clock()
        self.stats["commands"] += self.commands.poll(now, self)
        self._retry_ledger()
        self._housekeeping(now)

    def close(self) -> None:
        """Flush the ledger (idempotent; also runs at interpreter exit so no submitted entry is lost)."""
        if self._closed:
            return
        self._closed = True
        if self.tier is not None:
            self.tier.closing_shreds(self._clock())
        if self.custody is not None:
            self._forward([])  # the tier's last shreds, and events the ledger refused until now
            if self._unsent:
                _log.error("custody events the ledger never took", events=len(self._unsent))
        if self.custody is not None:
            self.reporter.close(self._clock(), self.custody.summary(), self._counters())
        self.commands.close()
        self.link.close()
        self.ledger.flush()
        self.ledger.close()
