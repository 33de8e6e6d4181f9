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
"""

from __future__ import annotations

import atexit
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from kvguard.control.engines import EngineRegistry
from kvguard.engine_adapter.custody import Custody
from kvguard.engine_adapter.ledger_bridge import LedgerBridge
from kvguard.engine_adapter.records import BlockStatus, CustodyEvent, PurgeSelector
from kvguard.engine_adapter.vllm.engine_link import CommandRunner
from kvguard.engine_adapter.vllm.intake import UNGOVERNED_TENANT, make_private, ungoverned_scope
from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, GuardWorkerMeta
from kvguard.engine_adapter.vllm.reporting import EngineReporter
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.engine_adapter.vllm.timing import PhaseTimer
from kvguard.engine_adapter.vllm.transport import Envelope, read_envelope
from kvguard.engine_adapter.vllm.wakeup import IdleWaker
from kvguard.errors import CustodyError, ScopeError
from kvguard.isolation.scope import Scope
from kvguard.logging import get_logger
from kvguard.policy import AuditLevel, PolicySet, TenantPolicy, Usage, Verify, admit

_log = get_logger("vllm.scheduler")
_VERIFY_RANK = {Verify.NONE: 0, Verify.SAMPLE: 1, Verify.FULL: 2}
__all__ = ["UNGOVERNED_TENANT", "SchedulerGuard"]
SWEEP_INTERVAL_S = 0.25


class SchedulerGuard:
    """Custody and policy for one vLLM scheduler (see the module docstring)."""

    def __init__(
        self,
        options: GuardOptions,
        *,
        model_name: str,
        block_size: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.options = options
        self.deriver = options.deriver()
        self.policies, self.policy_version = options.initial_policy()
        self.ledger = options.open_ledger()
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
        self._step = 0
        self._closed = False
        self.timer = PhaseTimer()
        self.engine_id = uuid.uuid4().hex[:12]
        self.commands = CommandRunner(
            self.engine_id, control_url=options.control_url, policy_url=options.policy_url
        )
        self.reporter = EngineReporter(
            EngineRegistry.open(options.control_url),
            engine_id=self.engine_id,
            tenant_tag=self.deriver.tenant_tag,
            clock=clock,
        )
        self._last_sweep = float("-inf")
        self._wake_requested = False  # set by the idle waker's thread, cleared by the next step
        self.waker = IdleWaker.attach(
            control_url=options.control_url,
            last_command=lambda: self.commands.last_id,
            cached_blocks=lambda: self.custody.cached_count if self.custody is not None else 0,
            request_wake=self._request_wake,
        )
        atexit.register(self.close)
        self.stats = self.reporter.stats  # engine-wide counters, reported with every heartbeat

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
        tag = self.deriver.scope_tag(scope)
        if tag not in self._tag_tenant:
            self._tag_tenant[tag] = scope.tenant_id
            self.reporter.new_tag(tag, scope.tenant_id)
        return tag

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
        if (
            envelope.use_cache
            and not admit(
                self.policies, envelope.scope, self._usage(envelope.scope.tenant_id)
            ).use_cache
        ):
            envelope = Envelope(scope=envelope.scope, use_cache=False)
        if not envelope.use_cache:
            make_private(request)
        self._envelopes[request.request_id] = envelope
        self._live[request.request_id] = request
        self.reporter.prompt(envelope.scope.tenant_id, int(request.num_prompt_tokens))

    def _usage(self, tenant: str) -> Usage:
        # Counting a tenant's blocks walks the pool: only worth it when a quota can bind.
        if self.policies.policy_for(tenant).quota.max_blocks is None:
            return Usage()
        counts = self._c.tenant_counts(tenant)
        return Usage(
            blocks_active=counts[BlockStatus.ACTIVE], blocks_cached=counts[BlockStatus.CACHED]
        )

    def request_finished(self, request: Any) -> None:
        """The request is done: quarantine what policy releases, keep what it retains."""
        rid = request.request_id
        if rid not in self._begun:
            self._envelopes.pop(rid, None)
            self._live.pop(rid, None)
            return
        self._end(rid, self._clock())
        self._envelopes.pop(rid, None)
        self._live.pop(rid, None)

    def _end(self, rid: str, now: float, *, hold: bool = True) -> None:
        c = self._c
        held_by = c.request_blocks(rid)
        self._mark_hashed(b for b in held_by if c.record(b).status is BlockStatus.ACTIVE)
        c.finish(rid, now)
        self._begun.discard(rid)
        for b in held_by:
            if (
                c.record(b).status is not BlockStatus.CACHED
                and c.record(b).status is not BlockStatus.ACTIVE
            ):
                self._evict_hash(b)
        if hold:
            self._hold_quarantined()

    # --- steps ----------------------------------------------------------------------------------

    def build_step(self, so: Any) -> GuardStepMeta:
        """Bring custody up to date with this step's schedule and say what the worker must clear."""
        c, now = self._c, self._clock()
        self._step += 1
        for rid in so.preempted_req_ids or ():
            self.stats["preemptions"] += 1
            if rid in self._begun:
                # The engine already freed these blocks and may have re-allocated some of them in
                # this very schedule; hold what is left only after the allocations below.
                self._end(rid, now, hold=False)
        canary: list[int] = []
        for new in so.scheduled_new_reqs:
            canary += self._scheduled(
                new.req_id, list(new.block_ids[0]), new.num_computed_tokens, now
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                canary += self._scheduled(
                    rid, list(ids[0]) if ids else [], cached.num_computed_tokens[i], now
                )
            elif ids and ids[0]:
                canary += self._allocate(rid, list(ids[0]), now)
        # After the allocations: a cached block the engine just re-assigned is active by now.
        self._housekeeping(now)
        self._wake_requested = False
        plan = c.take_plan()
        self._forward(c.take_events())
        if self.options.canary:
            c.check_invariants()  # test-only: G4 after every step (walks the whole pool)
        return GuardStepMeta(
            step=self._step,
            release=plan.release,
            handover=plan.handover,
            verify=self._verify_mode(plan.all_blocks),
            canary=tuple(sorted(set(canary))) if self.options.canary else (),
        )

    def _scheduled(
        self, rid: str, block_ids: list[int], num_computed: int, now: float
    ) -> list[int]:
        c = self._c
        env = self._envelopes.get(rid)
        if env is None:
            raise CustodyError(f"request {rid!r} was scheduled without on_new_request")
        if rid not in self._begun:
            c.begin(rid, env.scope, use_cache=env.use_cache)
            self._begun.add(rid)
        n_hit = num_computed // self._block_size if env.use_cache else 0
        hits, fresh = block_ids[:n_hit], block_ids[n_hit:]
        if hits:
            # Raises CustodyError on a cross-domain hit: the engine stops rather than serve it (G1).
            c.reuse(rid, hits, now, tokens_matched=num_computed)
            self.stats["reused_tokens"] += num_computed
            self.reporter.prefix_hit(env.scope.tenant_id, num_computed)
        return self._allocate(rid, fresh, now)

    def _allocate(self, rid: str, block_ids: list[int], now: float) -> list[int]:
        c = self._c
        scope = self._envelopes[rid].scope
        entering = [b for b in block_ids if not self._same_owner(b, scope)]
        owners = {b: o.tenant_id for b in entering if (o := c.record(b).owner) is not None}
        for b in block_ids:
            self._held.discard(b)  # the engine took a block back (e.g. freed by preemption)
        handover = c.allocate(rid, block_ids, now)
        self.reporter.handover_owners({b: owners[b] for b in handover if b in owners})
        self._mark_hashed(block_ids)
        return entering

    def _same_owner(self, block_id: int, scope: Scope) -> bool:
        owner = self._c.record(block_id).owner
        return owner is not None and owner.same_domain(scope)

    def _mark_hashed(self, block_ids: Iterable[int]) -> None:
        hashed = [b for b in block_ids if self._pool.blocks[b].block_hash is not None]
        if hashed:
            self._c.mark_hashed(hashed)

    def _verify_mode(self, block_ids: Iterable[int]) -> str:
        if self.options.verify_override:
            return self.options.verify_override
        best = Verify.NONE
        for b in block_ids:
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
            self._last_sweep = now
        if self.commands.due(now):
            self.stats["commands"] += self.commands.run(now, self)
        while self._purges:
            c.purge(self._purges.pop(0), now)
        self._hold_quarantined()
        if self.reporter.due(now):
            self.reporter.heartbeat(now, c.summary(), self._counters())

    # --- commands and reporting ---------------------------------------------------------------

    def purge_for_command(
        self, selector: PurgeSelector, now: float, command_id: int
    ) -> dict[str, int]:
        quarantined = self._c.purge(
            selector, now, details={"command_id": command_id, "engine_id": self.engine_id}
        )
        events = self._c.take_events()
        doomed = sum(
            int(e.details.get("blocks_active_doomed") or 0)
            for e in events
            if e.kind is selector.event_kind
        )
        self._forward(events)
        return {"blocks_quarantined": len(quarantined), "blocks_active_doomed": doomed}

    def use_policy(self, policies: PolicySet, version: int) -> None:
        self.policies, self.policy_version = policies, version

    def _counters(self) -> dict[str, int | float]:
        version = {} if self.policy_version is None else {"policy_version": self.policy_version}
        active = sum(int(getattr(r, "num_computed_tokens", 0) or 0) for r in self._live.values())
        return {"ledger_submitted": self.bridge.submitted, "active_tokens": active, **version}

    def _forward(self, events: list[CustodyEvent]) -> None:
        self.reporter.observe(events)
        with self.timer.phase("ledger_submit"):
            self.bridge.forward(events)

    def report_now(self) -> bool:
        """Write a heartbeat now (scheduler thread, or the caller's with an in-process engine)."""
        return self.reporter.heartbeat(self._clock(), self._c.summary(), self._counters())

    # --- pool holds -----------------------------------------------------------------------------

    def _hold_quarantined(self) -> None:
        for b in self._c.pending_release():
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
        if not isinstance(worker_meta, GuardWorkerMeta):
            return
        c, now = self._c, self._clock()
        for result in worker_meta.results:
            if not result.ok:
                # Only release clears report failures (a failed handover clear raises in the worker).
                self.stats["zeroize_failures"] += 1
                _log.error(
                    "zeroization failed; blocks stay quarantined", block_count=len(result.blocks)
                )
                c.requeue(result.blocks)
                continue
            self.reporter.zeroized(
                c, result.blocks, result.details, handover=result.handover, now=now
            )
            c.zeroized(
                result.blocks,
                now,
                {**dict(result.details), "engine_id": self.engine_id},
                handover=result.handover,
            )
            self.stats["blocks_zeroized"] += len(result.blocks)
            if result.handover:
                continue
            release = [self._pool.blocks[b] for b in result.blocks if b in self._held]
            self._held.difference_update(result.blocks)
            if release:
                self._pool.free_blocks(release)
        self._forward(c.take_events())

    def has_pending(self) -> bool:
        """True while blocks wait for zeroization (keeps the engine loop stepping)."""
        if self._wake_requested:  # the idle waker saw a new command or blocks that may expire
            return True
        return bool(self._held) or bool(self._purges) or self._c.has_pending_plan()

    def _request_wake(self) -> None:
        self._wake_requested = True

    def request_purge(self, selector: PurgeSelector) -> None:
        """Queue a purge; it takes effect at the next request arrival or engine step."""
        self._purges.append(selector)

    def poll(self) -> None:
        """Run the housekeeping that is due (expiry at most every SWEEP_INTERVAL_S, commands at most
        every poll interval or on NOTIFY). Only from the scheduler's thread between steps."""
        self._housekeeping(self._clock())

    def apply_now(self) -> None:
        """Run expiry and queued purges now. Only from the scheduler's thread between steps."""
        self._last_sweep = float("-inf")
        self._housekeeping(self._clock())

    def close(self) -> None:
        """Flush the ledger (idempotent; also runs at interpreter exit so no submitted entry is lost)."""
        if self._closed:
            return
        self._closed = True
        if self.waker is not None:
            self.waker.close()
        self.commands.close()
        if self.custody is not None:
            self.reporter.close(self._clock(), self.custody.summary(), self._counters())
        self.ledger.flush()
        self.ledger.close()
