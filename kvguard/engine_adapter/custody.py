"""The custody core: who holds every physical KV block, and what must happen to it next.

Engine-agnostic and pure (no tensors, no I/O, time passed in). An adapter reports what the engine did
(allocated, hit the prefix cache, finished a request) and custody answers with what kvguard must do:
blocks to quarantine and zeroize (G2), blocks to clear before a new owner's forward pass (G3),
ledger events (G5), and, for the metrics, how old cached blocks were when reused or retired
(`take_cache_ages`). Policy questions go to `kvguard.policy` through the `PolicyView` callable, so
custody holds no business rule of its own.

Ownership chain (SGLang-style): the engine owns block *ids* and its free queue; custody owns the
*custody state* of each id; the worker owns the bytes. Only custody moves an id between states, and
`check_invariants` proves after any sequence of operations that every block is in exactly one state
with one owner or none, and that the per-tenant counters add up (G4).
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final, cast

from kvguard.engine_adapter.records import (
    BlockId,
    BlockRecord,
    BlockStatus,
    CacheAge,
    CacheExit,
    CustodyEvent,
    EventKind,
    PoolSummary,
    PurgeSelector,
    RequestId,
    StepPlan,
    purge_event_kind,
    summarize,
    summary_of,
)
from kvguard.errors import CustodyError
from kvguard.isolation.scope import Scope
from kvguard.policy import TenantPolicy, ZeroizeOn
from kvguard.policy.decisions import (
    EXPIRY_MARGIN_S,
    expired_at,
    expiry_deadline,
    must_zeroize_owned,
)
from kvguard.zeroize.plan import digest_block_ids

_HELD = (BlockStatus.ACTIVE, BlockStatus.CACHED, BlockStatus.QUARANTINED)  # a tenant's, by quota
_FREE, _ACTIVE, _CACHED = BlockStatus.FREE, BlockStatus.ACTIVE, BlockStatus.CACHED
_QUARANTINED = BlockStatus.QUARANTINED
_PLAIN_INT = {int}
_NO_PLAN = StepPlan()
PolicyView = Callable[[str], TenantPolicy]  # tenant id -> its current policy
Tagger = Callable[[Scope], str]  # scope -> public scope tag
Details = dict[str, str | int | float | bool | None]


def _foreign(rec: BlockRecord, scope: Scope) -> bool:
    """Whether `rec`'s bytes are not `scope`'s to read: no owner, another reuse domain, or
    `_others_past_prefix`."""
    owner = rec.owner
    return owner is None or not owner.same_domain(scope) or _others_past_prefix(rec, scope)


def _others_past_prefix(rec: BlockRecord, scope: Scope) -> bool:
    """A share group's block past its listed prefix (not retained) that another tenant computed:
    that tenant's alone although the domain is shared (its hash is keyed with the tenant's secret,
    `intake.confine_hashes`, so a hit on it is defence in depth; a handover of it is cleared)."""
    return not rec.retain and rec.owner is not None and rec.owner.tenant_id != scope.tenant_id


_CLEAN_KEY: Final = (None, BlockStatus.FREE)  # the tally's key of a free block with no owner


class _Request:
    __slots__ = ("blocks", "doomed", "retain_blocks", "scope", "tag", "use_cache")

    def __init__(self, scope: Scope, tag: str, use_cache: bool, retain_blocks: int | None) -> None:
        self.scope = scope
        self.tag = tag  # the scope's public tag: its blocks' `owner_tag` and its events' tag
        self.use_cache = use_cache
        self.retain_blocks = retain_blocks  # only the first N blocks may be kept (share groups)
        self.blocks: list[BlockId] = []
        # A purge selected the request's scope while it ran: every block it holds or gets from
        # then on is doomed (never reused, never cached, zeroized when released).
        self.doomed = False


class _Keep:
    """An owner tenant's policy during one `Custody.finish`, its retention figures for
    `Custody._cache_inline` read once, and how many blocks the call cached inline."""

    __slots__ = ("cached", "cached_key", "cap", "idle", "inline", "policy", "ttl")

    def __init__(self, tenant: str, policy: TenantPolicy, *, inline: bool) -> None:
        self.policy = policy
        self.cap = policy.quota.max_blocks
        self.ttl, self.idle = policy.retention.ttl_s, policy.retention.idle_s
        # A TTL or idle limit of 0 keeps nothing (`expiry_deadline` is -inf): the general path.
        self.inline = inline and self.ttl > 0 and self.idle > 0
        self.cached_key = (tenant, _CACHED)
        self.cached = 0


class Custody:
    """Block custody for one engine's KV pool of `num_blocks` blocks."""

    # Tests set it False on one of two twins: the general path is the inline one's reference.
    _inline_finish = True

    def __init__(self, num_blocks: int, *, policy: PolicyView, tagger: Tagger) -> None:
        if num_blocks <= 0:
            raise CustodyError(f"num_blocks must be positive, got {num_blocks}")
        self._policy = policy
        self._tag = tagger
        self._blocks: list[BlockRecord] = [BlockRecord(BlockId(i)) for i in range(num_blocks)]
        self._requests: dict[RequestId, _Request] = {}
        self._pending_release: set[BlockId] = set()
        self._pending_handover: set[BlockId] = set()
        # Blocks added to `_pending_release` since the adapter last took them (`take_new_pending`):
        # it holds each quarantined block out of the engine's pool once, without walking them all.
        self._new_pending: list[BlockId] = []
        # Doomed blocks whose prefix hash the engine must drop from its index (`take_unhash`), and
        # the running requests a purge doomed (their later blocks are doomed as they come).
        self._unhash: list[BlockId] = []
        self._doomed_requests: set[RequestId] = set()
        # Doomed requests the engine preempted: doomed again when they resume (`begin`). And every
        # preempted request's scope until it resumes or ends, so that a purge landing meanwhile
        # dooms what it recomputes over the purged context.
        self._doomed_preempted: set[RequestId] = set()
        self._preempted: dict[RequestId, Scope] = {}
        self._events: list[CustodyEvent] = []
        self._cached: set[BlockId] = set()  # index of CACHED blocks
        # The expiry sweep's index: (earliest expiry, entry number, block) per cached block, in a
        # heap; `_expiry_entry` names each cached block's live entry (older ones are skipped).
        # `_retention_of` holds the retention each tenant's entries were computed with: a policy
        # change reschedules that tenant's blocks at the next sweep.
        self._expiry: list[tuple[float, int, BlockId]] = []
        self._expiry_entry: dict[BlockId, int] = {}
        self._entry_numbers = itertools.count()
        self._retention_of: dict[str, tuple[int, int]] = {}
        # Blocks per (owner tenant or None, status), kept by `_set` / `_retally`, and each tenant's
        # cached blocks by age (lazy heaps, entries numbered like the expiry index): `summary`
        # costs O(tenants), not a pass over the pool, on the scheduler thread every heartbeat.
        self._tally: Counter[tuple[str | None, BlockStatus]] = Counter(
            {(None, BlockStatus.FREE): num_blocks}
        )
        self._by_age: dict[str, list[tuple[float, int, BlockId]]] = {}
        # Handover blocks -> the owners whose bytes they held (scope, tag), oldest first: each clear
        # is its owner's evidence. A queue: on a GPU the verdict of a clear arrives a step or more
        # later, so a block can be handed over again before the first clear has reported.
        self._handover_from: dict[BlockId, deque[tuple[Scope | None, str | None]]] = {}
        # Release clears planned and not yet reported, per block; and those made stale because the
        # engine took the block back through a repair meanwhile (their results free nothing).
        self._release_inflight: Counter[BlockId] = Counter()
        self._stale_release: Counter[BlockId] = Counter()
        # Engine LRU evictions since the last take_events: (block, owner tag, when).
        self._evicted: list[tuple[BlockId, str | None, float]] = []
        # Ages of cached blocks reused or leaving the cache, for the metrics; the owner drains them.
        self._cache_ages: list[CacheAge] = []

    # --- queries ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def record(self, block_id: int) -> BlockRecord:
        return self._blocks[self._check_id(block_id)]

    @property
    def records(self) -> Sequence[BlockRecord]:
        """Every block's record, indexed by block id (read-only: only custody changes them). For
        adapters' per-step loops over ids custody has already checked; `record` checks the id."""
        return self._blocks

    def counts(self) -> dict[BlockStatus, int]:
        tally = Counter(r.status for r in self._blocks)
        return {s: tally.get(s, 0) for s in BlockStatus}

    def tenant_blocks(self, tenant_id: str) -> int:
        """Blocks a tenant holds (active, cached or awaiting zeroization): what quotas count."""
        tally = self._tally
        return sum(tally.get((tenant_id, s), 0) for s in _HELD)

    def tenant_cached(self, tenant_id: str) -> int:
        """Blocks the tenant has cached now (O(1), from the running tally)."""
        return self._tally.get((tenant_id, BlockStatus.CACHED), 0)

    def cached_tenants(self) -> list[str]:
        """The tenants with blocks cached now (O(tenants))."""
        return [t for t in self._by_age if self.tenant_cached(t)]

    def tenant_active(self, tenant_id: str) -> int:
        """Blocks held by the tenant's running requests now (O(1), from the running tally)."""
        return self._tally.get((tenant_id, BlockStatus.ACTIVE), 0)

    def tenant_counts(self, tenant_id: str) -> dict[BlockStatus, int]:
        tally = Counter(
            r.status for r in self._blocks if r.owner is not None and r.owner.tenant_id == tenant_id
        )
        return {s: tally.get(s, 0) for s in BlockStatus}

    def summary(self) -> PoolSummary:
        """Counts by state and per owning tenant, with each tenant's oldest cached block, from the
        running tally (O(tenants); `records.summarize` is the same figures from a pass over the
        pool, and `check_invariants` compares the two)."""
        return summary_of(self._tally.items(), self._oldest_cached)

    def _oldest_cached(self, tenant: str) -> float | None:
        heap = self._by_age.get(tenant)
        while heap and self._expiry_entry.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)  # the block left the cache, or was rescheduled, since this entry
        return heap[0][0] if heap else None

    def request_blocks(self, request_id: str) -> tuple[int, ...]:
        """The blocks a registered request holds (empty if it is not registered)."""
        req = self._requests.get(RequestId(request_id))
        return tuple(dict.fromkeys(req.blocks)) if req else ()

    def handover_owner(self, block_id: int) -> Scope | None:
        """The scope whose bytes the oldest pending handover clear of `block_id` removes (None:
        unknown)."""
        queue = self._handover_from.get(BlockId(block_id))
        return queue[0][0] if queue else None

    def pending_release(self) -> tuple[int, ...]:
        """Quarantined blocks not yet handed to the worker (the adapter holds them out of the pool)."""
        return tuple(self._pending_release)

    def take_new_pending(self) -> list[int]:
        """The blocks quarantined (or planned again) since the last call that still wait for their
        clear: what the adapter has not yet held out of the pool. O(new), not O(pending)."""
        new, self._new_pending = self._new_pending, []
        pending = self._pending_release
        return [b for b in new if b in pending]

    @property
    def cached_count(self) -> int:
        """Blocks cached now (O(1); safe to read from another thread, as an approximate hint)."""
        return len(self._cached)

    def has_pending_plan(self) -> bool:
        return bool(self._pending_release or self._pending_handover)

    @property
    def settled(self) -> bool:
        """Nothing for the adapter to take: no plan, event, engine eviction, cache age, newly
        pending block or doomed hash (O(1): the adapter's check for a step with nothing to do)."""
        return not (
            self._pending_release
            or self._pending_handover
            or self._events
            or self._evicted
            or self._cache_ages
            or self._new_pending
            or self._unhash
            or self._doomed_requests
        )

    def requeue(self, block_ids: Iterable[int]) -> None:
        """Zeroization of these blocks failed: plan them again (quarantined ones stay out of the pool)."""
        for bid in self.current_release_results(block_ids):
            rec = self._blocks[bid]
            if rec.status is BlockStatus.QUARANTINED:
                self._pending_release.add(rec.block_id)
                self._new_pending.append(rec.block_id)

    def current_release_results(self, block_ids: Iterable[int]) -> list[BlockId]:
        """Of the blocks a release clear's result names, those it still speaks for; consumes the
        result for each block. A result is stale when the engine took the block back through a
        repair after the clear was planned: the block is someone else's by now, its old owner's
        bytes are covered by the repair's handover clear, and the result must free nothing."""
        current: list[BlockId] = []
        for bid in map(self._check_id, block_ids):
            if self._stale_release[bid] > 0:
                self._stale_release[bid] -= 1
                if not self._stale_release[bid]:
                    del self._stale_release[bid]
                continue
            inflight = self._release_inflight.get(bid, 0)
            if not inflight:
                # No release clear of it is on its way: a verdict custody never asked for (one
                # delivered twice) frees nothing, whatever the block holds now.
                continue
            if inflight == 1:
                del self._release_inflight[bid]
            else:
                self._release_inflight[bid] = inflight - 1
            if self._blocks[bid].status is _QUARANTINED:  # else custody lost track: free nothing
                current.append(bid)
        return current

    def tags_in_use(self) -> set[str]:
        """Every tag custody will put on an event without asking for it again: its running
        requests', its blocks' owners' and those of pending handover clears (O(pool))."""
        tags = {req.tag for req in self._requests.values()}
        tags.update(rec.owner_tag for rec in self._blocks if rec.owner_tag is not None)
        for queue in self._handover_from.values():
            tags.update(tag for _, tag in queue if tag is not None)
        tags.update(tag for _, tag, _ in self._evicted if tag is not None)
        return tags

    def take_events(self) -> list[CustodyEvent]:
        """Drain the events produced since the last call (vLLM `take_events` pattern)."""
        if self._evicted:
            by_tag: dict[str | None, list[BlockId]] = {}
            for bid, tag, _ in self._evicted:
                by_tag.setdefault(tag, []).append(bid)
            now = self._evicted[-1][2]
            self._evicted = []
            self._events.extend(
                CustodyEvent(EventKind.EVICT, now, tag, None, tuple(g), {"reason": "engine_lru"})
                for tag, g in by_tag.items()
            )
        events, self._events = self._events, []
        return events

    def take_cache_ages(self) -> list[CacheAge]:
        """Drain the cache ages recorded since the last call (prefix hits, evictions, expiries,
        purges of cached blocks): the cache-age histogram's observations."""
        ages, self._cache_ages = self._cache_ages, []
        return ages

    def take_plan(self) -> StepPlan:
        """Drain the blocks that must be zeroized before the next forward pass."""
        # What was not held by now is planned (or was taken back) now: nothing left to hold.
        self._new_pending.clear()
        if not self._pending_release and not self._pending_handover:
            return _NO_PLAN  # most decode steps
        plan = StepPlan(
            release=tuple(sorted(self._pending_release)),
            handover=tuple(sorted(self._pending_handover)),
        )
        self._release_inflight.update(BlockId(b) for b in plan.release)
        self._pending_release.clear()
        self._pending_handover.clear()
        return plan

    # --- request lifecycle -----------------------------------------------------------------------

    def begin(
        self, request_id: str, scope: Scope, *, use_cache: bool, retain_blocks: int | None = None
    ) -> None:
        """Register a request admitted by policy under `scope` (use_cache False: nothing retained;
        `retain_blocks`: only its first N blocks may stay cached, the rest are released)."""
        rid = RequestId(request_id)
        if rid in self._requests:
            raise CustodyError(f"request {request_id!r} is already registered")
        req = self._requests[rid] = _Request(scope, self._tag(scope), use_cache, retain_blocks)
        self._preempted.pop(rid, None)
        if rid in self._doomed_preempted:  # resumed after a preemption: recomputes purged context
            self._doomed_preempted.discard(rid)
            req.doomed = True
            self._doomed_requests.add(rid)

    def forget(self, request_id: str) -> None:
        """The engine is done with a request custody does not hold now (one that ended while
        preempted): forget what was kept for its resumption."""
        self._doomed_preempted.discard(RequestId(request_id))
        self._preempted.pop(RequestId(request_id), None)

    def allocate(
        self, request_id: str, block_ids: Iterable[int], now: float, *, start: int | None = None
    ) -> tuple[int, ...]:
        """The engine gave `request_id` these blocks for new tokens; `start` is the first one's index
        in the request's block table (default: after the blocks custody has seen it get).

        Returns the blocks that hold another scope's bytes and must be zeroized before this request's
        forward pass writes into them (G3); they are also queued in the step plan.
        """
        req = self._request(request_id)
        fresh = self._ids(block_ids)
        self._check_allocatable(fresh)
        return tuple(self._grant(req, request_id, fresh, now, start))

    def allocate_many(self, grants: Sequence[tuple[str, list[int]]], now: float) -> list[int]:
        """`allocate` for several requests at once, each getting blocks after those custody has
        seen it get (a decode step: every running request that crossed a block boundary gets
        one). Checked whole before anything changes: on a CustodyError custody is as it was, so
        the caller can go request by request and repair the one at fault. Returns the blocks
        that need a handover clear."""
        requests = cast("dict[str, _Request]", self._requests)  # a RequestId is a str
        found = [requests.get(rid) for rid, _ in grants]
        if None in found:
            for rid, _ in grants:
                self._request(rid)  # raises for the first one not registered
        reqs = cast("list[_Request]", found)
        fresh = self._ids([b for _, ids in grants for b in ids])
        self._check_allocatable(fresh)
        handover: list[int] = []
        at = 0
        for (rid, ids), req in zip(grants, reqs, strict=True):
            handover += self._grant(req, rid, fresh[at : at + len(ids)], now, None)
            at += len(ids)
        return handover

    def _grant(
        self, req: _Request, request_id: str, fresh: list[BlockId], now: float, start: int | None
    ) -> list[BlockId]:
        """Give checked blocks (`_check_allocatable`) to a request; its handover clears."""
        rid = RequestId(request_id)
        blocks, scope = self._blocks, req.scope
        handover: list[BlockId] = []
        # The block-table index only matters under a retain limit (`_take`): not counted otherwise.
        if start is not None:
            first = start
        else:
            first = len(dict.fromkeys(req.blocks)) if req.retain_blocks is not None else 0
        active = (scope.tenant_id, _ACTIVE)
        tag, limit, use_cache = req.tag, req.retain_blocks, req.use_cache
        clean = 0  # clean free blocks taken: counted once in the tally, after the loop
        for offset, bid in enumerate(fresh):
            rec = blocks[bid]
            status = rec.status
            if status is _FREE and rec.owner is None and not req.doomed:
                # A clean free block (most allocations): `_take` and `_set` inlined, same effects.
                rec.owner, rec.owner_tag, rec.doomed = scope, tag, False
                rec.retain = use_cache and (limit is None or first + offset < limit)
                rec.status, rec.quarantined_at, rec.hashed = _ACTIVE, None, False
                rec.tally_key = active
                clean += 1
                rec.holders.add(rid)
                rec.last_used_at = rec.created_at = now
                req.blocks.append(bid)
                continue
            if status is not _FREE:
                if status is _QUARANTINED:
                    self._engine_took_quarantined(rec)
                else:
                    self._engine_evicted(rec, now)
            # A doomed block holds purged context: cleared whoever gets it next, also its own
            # domain under `cross_scope` (vLLM may hand a preempted doomed request's blocks to a
            # same-domain request in the preempting schedule, before their release clear ran).
            if rec.owner is not None and (
                rec.doomed or self._needs_clear(rec, scope) or _others_past_prefix(rec, scope)
            ):
                handover.append(bid)
                self._handover_owner(rec)
            self._take(rec, req, rid, now, first + offset)
            rec.created_at = now
            rec.hashed = False
        if clean:  # `_retally` of each: a clean free block is counted under `_CLEAN_KEY`
            tally = self._tally
            tally[_CLEAN_KEY] -= clean  # no other path of this loop counts a block under it
            if not tally[_CLEAN_KEY]:
                del tally[_CLEAN_KEY]
            tally[active] += clean
        self._pending_handover.update(handover)
        if fresh:
            self._events.append(
                CustodyEvent(
                    EventKind.ALLOC,
                    now,
                    req.tag,
                    request_id,
                    tuple(fresh),
                    {"handover_zeroize": len(handover)},
                )
            )
        return handover

    def _check_allocatable(self, fresh: list[BlockId]) -> None:
        """Refuse an allocation custody cannot account for before changing anything: a repair
        (`seize`) then starts from the state the engine's schedule found, so every block still
        holding another owner's bytes is cleared (found by a review: an allocation refused at
        its second block had already given the first to the request, with its handover clear
        never planned, and the repair took the first block as the request's own)."""
        blocks, pending = self._blocks, self._pending_release
        for bid in fresh:
            status = blocks[bid].status
            if status is _ACTIVE:
                raise CustodyError(f"block {bid} allocated while active")
            if status is _QUARANTINED and bid not in pending:
                raise CustodyError(f"block {bid} allocated while quarantined for zeroization")
        if len(set(fresh)) != len(fresh):
            raise CustodyError("a block allocated twice to one request in one step")

    def backdate(self, block_id: int, created_at: float) -> None:
        """An active block holds bytes first computed at `created_at` (restored from the offload
        tier): its owner's retention counts from then, so spilling and restoring never renews it."""
        rec = self._blocks[self._check_id(block_id)]
        if rec.status is not BlockStatus.ACTIVE:
            raise CustodyError(f"block {block_id} backdated while {rec.status.value}")
        rec.created_at = min(rec.created_at, created_at)

    def reuse(
        self, request_id: str, block_ids: Iterable[int], now: float, *, tokens_matched: int
    ) -> None:
        """The engine served `request_id` from cached blocks (a prefix hit).

        Defence in depth (G1): the salts should make a cross-domain hit impossible; if one happens
        anyway the request is refused here rather than served another scope's KV.
        """
        req = self._request(request_id)
        ids, blocks, scope = self._ids(block_ids), self._blocks, req.scope
        for bid in ids:
            rec = blocks[bid]
            if _foreign(rec, scope) or not rec.hashed:
                raise CustodyError(
                    f"prefix hit on block {bid} outside the request's reuse domain; refused (G1)"
                )
            if rec.status is BlockStatus.QUARANTINED:
                raise CustodyError(f"prefix hit on quarantined block {bid}; refused")
            if rec.doomed:
                raise CustodyError(f"prefix hit on block {bid}, doomed by a purge; refused")
        rid, ages = RequestId(request_id), self._cache_ages
        for bid in ids:
            rec = blocks[bid]
            ages.append(CacheAge(CacheExit.REUSED, now - rec.created_at))
            self._take(rec, req, rid, now)
        if ids:
            self._events.append(
                CustodyEvent(
                    EventKind.REUSE,
                    now,
                    req.tag,
                    request_id,
                    tuple(ids),
                    {"tokens_matched": tokens_matched},
                )
            )

    def seize(self, request_id: str, block_ids: Iterable[int], now: float, *, reason: str) -> None:
        """Repair: give `request_id` these blocks although custody could not account for the engine
        handing them over (a prefix hit custody refused, say). Every block whose bytes belong to
        another reuse domain, or whose state is unknown, is cleared before the forward pass (a handover
        clear), so the request computes on zeros rather than on foreign KV, and the engine keeps
        running. Recorded as a `custody.repair` event; the request's output for those tokens is
        garbage, which is the price of not serving another scope's state (G1, G3)."""
        req = self._request(request_id)
        ids = list(dict.fromkeys(self._check_id(b) for b in block_ids))
        cleared: list[BlockId] = []
        for bid in ids:
            rec = self._blocks[bid]
            # A block doomed by a purge holds the purged context: cleared like another domain's.
            foreign = _foreign(rec, req.scope) or rec.doomed
            # A block already in this step's handover list holds the bytes of the owner that
            # allocation recorded; the owner it got since has not run a forward pass on it, so it
            # is not queued as a second owner (found by a review: that owner was named by the
            # block's next clear, another tenant's).
            if foreign and bid not in self._pending_handover:
                self._handover_owner(rec)
            if rec.status is BlockStatus.QUARANTINED:
                self._pending_release.discard(bid)
                # A release clear of it still on its way no longer speaks for the block.
                self._stale_release[bid] += self._release_inflight.pop(bid, 0)
                self._set(rec, BlockStatus.FREE)
            elif rec.status is BlockStatus.CACHED:
                self._set(rec, BlockStatus.FREE)
            if foreign:
                cleared.append(bid)
            if rec.status is BlockStatus.ACTIVE and foreign:
                # Shared with requests of another domain: they lose their cached prefix too.
                rec.owner = None
                self._retally(rec)
            self._take(rec, req, RequestId(request_id), now)
            rec.hashed = False
        self._pending_handover.update(cleared)
        self._emit(
            EventKind.CUSTODY_REPAIR,
            now,
            req.scope,
            request_id,
            ids,
            {"reason": reason, "blocks_cleared": len(cleared)},
        )

    def quota_deferred(
        self, request_id: str, scope: Scope, now: float, *, blocks_requested: int, cap: int
    ) -> None:
        """Record that a request waits because it would take its tenant past its block quota."""
        self._emit(
            EventKind.QUOTA_DEFER,
            now,
            scope,
            request_id,
            (),
            {"blocks_requested": blocks_requested, "blocks_quota": cap},
        )

    def mark_hashed(self, block_ids: Iterable[int]) -> None:
        """The engine registered prefix hashes for these (full) blocks: they are reusable."""
        blocks = self._blocks
        for bid in self._ids(block_ids):
            rec = blocks[bid]
            if rec.status is not _ACTIVE:
                raise CustodyError(f"block {bid} hashed while {rec.status.value}")
            if rec.doomed:  # never reusable: the engine drops the hash (`take_unhash`)
                self._unhash.append(rec.block_id)
                continue
            rec.hashed = True

    def finish(self, request_id: str, now: float, *, preempted: bool = False) -> tuple[int, ...]:
        """The request is done (`preempted`: for now; it may resume, and a purge that doomed it
        still holds then). Returns the blocks quarantined for zeroization (the engine must not
        free them until `zeroized` is called); the rest are cached or were still shared."""
        rid = RequestId(request_id)
        req = self._requests.pop(rid, None)
        if req is None:
            raise CustodyError(f"request {request_id!r} is not registered")
        self._doomed_requests.discard(rid)
        if preempted:
            self._preempted[rid] = req.scope
            if req.doomed:
                self._doomed_preempted.add(rid)
        quarantined: list[int] = []
        retained = residue = 0
        blocks = self._blocks
        keep: dict[str, _Keep] = {}  # each owner tenant's policy, looked up once, not per block
        for bid in dict.fromkeys(req.blocks):
            rec = blocks[bid]
            holders = rec.holders
            holders.discard(rid)
            if holders:
                continue
            owner = rec.owner
            if owner is not None:
                tenant = owner.tenant_id
                k = keep.get(tenant) or keep.setdefault(tenant, self._keep(tenant, now))
                inline = (  # most blocks: cached here, or False with nothing changed
                    k.inline
                    and rec.status is _ACTIVE
                    and rec.retain
                    and rec.hashed
                    and not rec.doomed
                    and self._cache_inline(rec, tenant, k, now)
                )
                if inline or self._keep_cached(rec, now, k.policy):
                    if not inline:
                        self._cache(rec, tenant, k.policy)
                    retained += 1
                    continue
            if self._zeroize_now(rec):
                self._quarantine(rec, now)
                quarantined.append(bid)
            else:
                # `cross_scope`: back to the free pool with its residue; cleared on handover (G3).
                self._set(rec, _FREE)
                rec.hashed = False
                residue += 1
        for tenant in [t for t, k in keep.items() if k.cached]:
            self._compact_ages(tenant)
        if quarantined or retained or residue:
            details: Details = {"retained": retained, "freed_unzeroized": residue}
            self._events.append(
                CustodyEvent(
                    EventKind.RELEASE, now, req.tag, request_id, tuple(quarantined), details
                )
            )
        return tuple(quarantined)

    # --- retention ------------------------------------------------------------------------------

    def sweep(self, now: float) -> tuple[int, ...]:
        """Quarantine every cached block whose owner's policy says it has expired (TTL or idle).

        Looks only at blocks whose expiry may have come (an index ordered by earliest expiry) and
        at each tenant's retention (a changed one reschedules that tenant's blocks), not at every
        cached block: a GPU engine caches ~10^5 blocks and sweeps four times a second."""
        self._reschedule_changed_retention()
        out: list[int] = []
        later: list[BlockId] = []
        heap, entries = self._expiry, self._expiry_entry
        policies: dict[str, TenantPolicy] = {}
        while heap and heap[0][0] <= now:
            _, number, bid = heapq.heappop(heap)
            if entries.get(bid) != number:
                continue  # the block left the cache, or was rescheduled, since this entry
            rec = self._blocks[bid]
            assert rec.owner is not None  # a cached block has an owner
            tenant = rec.owner.tenant_id
            policy = policies.get(tenant) or policies.setdefault(tenant, self._policy(tenant))
            if expired_at(policy, rec.created_at, rec.last_used_at, now):
                self._cache_ages.append(CacheAge(CacheExit.EXPIRED, now - rec.created_at))
                self._quarantine(rec, now)
                out.append(bid)
            else:
                later.append(bid)
        for bid in later:
            self._schedule_expiry(self._blocks[bid])
        if len(heap) > 2 * len(self._expiry_entry) + 64:  # drop dead entries now and then: O(n)
            self._expiry = [e for e in heap if self._expiry_entry.get(e[2]) == e[1]]
            heapq.heapify(self._expiry)
        out.sort()
        self._emit_grouped(EventKind.EVICT, now, out, {"reason": "expired"})
        return tuple(out)

    def reclaim_over_quota(self, tenant: str, now: float) -> tuple[int, ...]:
        """Quarantine the tenant's oldest cached blocks while its active and cached blocks together
        exceed its quota (docs/policy.md: the quota bounds both; custody reclaims the tenant's own
        cache, never another tenant's). Called once its running work has grown (a step's
        allocations); one `block.evict` entry (reason `quota`)."""
        cap = self._policy(tenant).quota.max_blocks
        if cap is None:
            return ()
        over = self.tenant_active(tenant) + self.tenant_cached(tenant) - cap
        if over <= 0 or not self.tenant_cached(tenant):
            return ()
        ages, entries = self._by_age.get(tenant, []), self._expiry_entry
        out: list[int] = []
        while ages and len(out) < over:
            _, number, bid = heapq.heappop(ages)
            if entries.get(bid) != number:
                continue  # the block left the cache, or was rescheduled, since this entry
            rec = self._blocks[bid]
            self._cache_ages.append(CacheAge(CacheExit.EVICTED, now - rec.created_at))
            self._quarantine(rec, now)
            out.append(bid)
        out.sort()
        self._emit_grouped(EventKind.EVICT, now, out, {"reason": "quota"})
        return tuple(out)

    def _keep(self, tenant: str, now: float) -> _Keep:
        # A clock that is not finite goes the general path, whose `expired_at` refuses it (found
        # by a review: NaN compares False with every deadline, so the inline path cached).
        inline = self._inline_finish and math.isfinite(now)
        return _Keep(tenant, self._policy(tenant), inline=inline)

    def _cache_inline(self, rec: BlockRecord, tenant: str, k: _Keep, now: float) -> bool:
        """Cache an active, retained, hashed, undoomed block of `tenant` that a finished request
        leaves, when its quota has room and its expiry is clearly ahead (most blocks): the
        effects of `_keep_cached` and `_cache` (the tally, the cached set, both expiry indexes)
        with the policy's figures read once per request (`_keep`). False, with nothing changed,
        when the block needs the general path (a cache at its quota, an expiry within the
        margin: `expired_at` decides those exactly)."""
        tally = self._tally
        if k.cap is not None and tally.get(k.cached_key, 0) >= k.cap:
            return False
        deadline = min(rec.created_at + k.ttl, rec.last_used_at + k.idle) - EXPIRY_MARGIN_S
        if now >= deadline:
            return False
        bid = rec.block_id
        rec.status, rec.quarantined_at = _CACHED, None
        old = rec.tally_key  # (tenant, active): an active block is counted under its owner
        tally[old] -= 1
        if not tally[old]:
            del tally[old]
        tally[k.cached_key] += 1
        rec.tally_key = k.cached_key
        self._cached.add(bid)
        if not k.cached:  # `_schedule_expiry`'s first-block rule, once a call and tenant
            self._retention_of.setdefault(tenant, (k.ttl, k.idle))
        k.cached += 1
        self._index_expiry(tenant, bid, deadline, rec.created_at)
        return True

    def _schedule_expiry(self, rec: BlockRecord, policy: TenantPolicy | None = None) -> None:
        assert rec.owner is not None
        tenant = rec.owner.tenant_id
        if policy is None:
            policy = self._policy(tenant)
        retention = policy.retention
        # Only a tenant's first cached block sets what its blocks were scheduled with: a later one
        # cached under a changed retention must not hide the change from the next sweep, which
        # reschedules the tenant's older blocks (found by a review: a block cached right after a
        # retention cut kept every older block on its old, longer deadline).
        self._retention_of.setdefault(tenant, (retention.ttl_s, retention.idle_s))
        deadline = expiry_deadline(policy, rec.created_at, rec.last_used_at)
        self._index_expiry(tenant, rec.block_id, deadline, rec.created_at)
        self._compact_ages(tenant)

    def _index_expiry(self, tenant: str, bid: BlockId, deadline: float, created_at: float) -> None:
        """A cached block's live entry in the expiry index and its owner's age index."""
        number = next(self._entry_numbers)
        self._expiry_entry[bid] = number
        heapq.heappush(self._expiry, (deadline, number, bid))
        heapq.heappush(self._by_age.setdefault(tenant, []), (created_at, number, bid))

    def _compact_ages(self, tenant: str) -> None:
        """Drop the tenant's dead age entries now and then (O(its entries), amortised)."""
        ages = self._by_age[tenant]
        if len(ages) > 2 * self.tenant_cached(tenant) + 64:
            live = [e for e in ages if self._expiry_entry.get(e[2]) == e[1]]
            heapq.heapify(live)
            self._by_age[tenant] = live

    def _reschedule_changed_retention(self) -> None:
        """Reschedule the cached blocks of tenants whose retention changed since they were
        scheduled (a policy command); forget tenants with nothing cached. O(tenants) when nothing
        changed, O(the changed tenants' cached blocks) otherwise: each tenant's age heap holds a
        live entry for every block it has cached (`_check_indexes`)."""
        for tenant, seen in list(self._retention_of.items()):
            if not self.tenant_cached(tenant):
                del self._retention_of[tenant]
                continue
            retention = self._policy(tenant).retention
            if (retention.ttl_s, retention.idle_s) == seen:
                continue
            entries = self._expiry_entry
            live = [bid for _, n, bid in self._by_age.get(tenant, ()) if entries.get(bid) == n]
            for bid in live:  # a snapshot: rescheduling pushes onto the same heap
                self._schedule_expiry(self._blocks[bid])
            self._retention_of[tenant] = (retention.ttl_s, retention.idle_s)

    def purge(
        self, selector: PurgeSelector, now: float, *, details: Details | None = None
    ) -> tuple[int, ...]:
        """Quarantine cached blocks of the selected owners; active ones are quarantined on release."""
        out: list[int] = []
        doomed = 0
        for rec in self._blocks:
            if rec.owner is None or not selector.matches(rec.owner):
                continue
            if rec.status is BlockStatus.CACHED:
                self._cache_ages.append(CacheAge(CacheExit.PURGED, now - rec.created_at))
                self._quarantine(rec, now)
                out.append(rec.block_id)
            elif rec.status is BlockStatus.ACTIVE:
                self._doom(rec)
                doomed += 1
            elif rec.status is BlockStatus.FREE:
                # Residue left in the free pool under `cross_scope`: clear it now as well.
                self._quarantine(rec, now)
                out.append(rec.block_id)
        # The purge follows the selected requests still running: what they compute from here on
        # derives from the purged context, so it is doomed too (`_take`), never cached or reused.
        for rid, req in self._requests.items():
            if selector.matches(req.scope):
                req.doomed = True
                self._doomed_requests.add(rid)
        for rid, scope in self._preempted.items():  # doomed again when they resume (`begin`)
            if selector.matches(scope):
                self._doomed_preempted.add(rid)
        self._events.append(
            CustodyEvent(
                purge_event_kind(selector),
                now,
                None,
                None,
                tuple(out),
                {**(details or {}), "blocks_quarantined": len(out), "blocks_active_doomed": doomed},
            )
        )
        return tuple(out)

    def retire_unshareable(self, shareable: Callable[[Scope], bool], now: float) -> tuple[int, ...]:
        """A new policy version is in force: every block whose owner scope may no longer serve
        even its own domain (`shareable` False: the epoch moved on, the creating tenant withdrew
        the share or was disabled) leaves the cache now, quarantined and zeroized (one
        `block.evict` entry per owner, reason `policy`); active ones are doomed (never cached).
        O(pool), once per policy change."""
        verdicts: dict[Scope, bool] = {}
        out: list[int] = []
        for rec in self._blocks:
            owner = rec.owner
            if owner is None or rec.status is _QUARANTINED:
                continue
            if self._verdict(verdicts, shareable, owner):
                continue
            if rec.status is BlockStatus.CACHED:
                self._cache_ages.append(CacheAge(CacheExit.EVICTED, now - rec.created_at))
                self._quarantine(rec, now)
                out.append(rec.block_id)
            elif rec.status is _FREE:
                # Residue left in the free pool under `cross_scope`, which the next owner of its
                # domain would get uncleared: its owner no longer shares it (as a purge does; found
                # by a review: a tenant that withdrew from the public scope, or was disabled, left
                # its tail blocks to the next public request).
                self._quarantine(rec, now)
                out.append(rec.block_id)
            else:
                self._doom(rec)
        # Running requests under such a scope are doomed too: the blocks they get from now on (a
        # later prefill chunk, decode) would otherwise be cached under it when they end (found by
        # a review: a withdrawn member's request kept caching for the group). Preempted ones are
        # not: the adapter decides their scope again when they resume, from the version in force.
        for rid, req in self._requests.items():
            if not self._verdict(verdicts, shareable, req.scope):
                req.doomed = True
                self._doomed_requests.add(rid)
        self._emit_grouped(EventKind.EVICT, now, out, {"reason": "policy"})
        return tuple(out)

    @staticmethod
    def _verdict(
        verdicts: dict[Scope, bool], shareable: Callable[[Scope], bool], scope: Scope
    ) -> bool:
        """`shareable(scope)`, asked once per scope (`verdicts` remembers)."""
        allowed = verdicts.get(scope)
        if allowed is None:
            allowed = verdicts[scope] = shareable(scope)
        return allowed

    def _doom(self, rec: BlockRecord) -> None:
        if not rec.doomed:
            rec.doomed = True
            rec.hashed = False  # its prefix hash leaves the engine's index (`take_unhash`)
            self._unhash.append(rec.block_id)

    @property
    def has_doomed(self) -> bool:
        """True while doomed hashes wait to be dropped or purge-doomed requests run."""
        return bool(self._unhash or self._doomed_requests)

    def take_unhash(self) -> list[int]:
        """Doomed blocks whose prefix hashes the engine must drop (so nothing can hit them)."""
        out: list[int] = list(self._unhash)
        self._unhash.clear()
        return out

    def doomed_requests(self) -> list[tuple[str, list[BlockId]]]:
        """Running requests a purge doomed, each with its blocks in the order it got them (the
        engine drops any prefix hash it gave them since: a block that filled up during decode is
        hashed without custody's call)."""
        return [(rid, self._requests[rid].blocks) for rid in self._doomed_requests]

    def zeroized(
        self, block_ids: Iterable[int], now: float, details: Details, *, handover: bool = False
    ) -> None:
        """The worker zeroized (and verified per policy) these blocks.

        Release clears (`handover=False`) return quarantined blocks to the free pool, clean. Handover
        clears ran before the new owner's forward pass, which has written into the blocks since, so
        they change no state (the block may even be cached or quarantined again by now): the event is
        the evidence that the old owner's bytes were gone before the new owner got the block."""
        ids = self._ids(block_ids)
        owners: dict[BlockId, str | None] = {}
        for bid in ids:
            if handover:
                queue = self._handover_from.get(bid)
                owners[bid] = queue.popleft()[1] if queue else None
                if queue is not None and not queue:
                    del self._handover_from[bid]
                continue
            rec = self._blocks[bid]
            if rec.status is not BlockStatus.QUARANTINED:
                raise CustodyError(f"block {bid} reported zeroized while {rec.status.value}")
            owners[bid] = rec.owner_tag
            self._set(rec, _FREE)
            rec.owner = rec.owner_tag = None
            self._retally(rec)
            rec.hashed = rec.doomed = False
            rec.retain = True
        self._emit_zeroize(now, ids, owners, {**details, "handover": handover})

    def _emit_zeroize(
        self, now: float, ids: list[BlockId], owners: dict[BlockId, str | None], details: Details
    ) -> None:
        """One `block.zeroize` event per owner whose bytes were cleared (G5, G6): a tenant's export
        holds the evidence for its own blocks and nothing about another tenant's. Parts of one clear
        share a random `batch_id` (it links them and reveals nothing: a digest or a count of the
        whole clear's ids would let one tenant enumerate the others' block ids, or count them);
        block count, ids digest and bytes are the part's own (bytes in proportion), and of the
        verification figures the part keeps the mode and the verdict, and as `blocks_verified` at
        most its own block count."""
        groups: dict[str | None, list[BlockId]] = {}
        for bid in ids:
            groups.setdefault(owners.get(bid), []).append(bid)
        total = details.get("bytes_cleared")
        batch = secrets.token_hex(8) if len(groups) > 1 else None
        for tag, group in groups.items():
            part: Details = dict(details)
            if batch is not None:
                part["batch_id"] = batch
                part["block_count"] = len(group)
                part["block_ids_sha256"] = digest_block_ids(group)
                if isinstance(total, int) and not isinstance(total, bool):
                    part["bytes_cleared"] = total // len(ids) * len(group)
                verified = part.get("blocks_verified")
                if isinstance(verified, int) and not isinstance(verified, bool):
                    part["blocks_verified"] = min(verified, len(group))
            self._events.append(CustodyEvent(EventKind.ZEROIZE, now, tag, None, tuple(group), part))

    # --- invariants (G4) --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise CustodyError unless every block is in exactly one consistent state (G4)."""
        tenants: Counter[str] = Counter()
        held: dict[BlockId, set[RequestId]] = {}
        for rid, req in self._requests.items():
            for bid in req.blocks:
                held.setdefault(bid, set()).add(rid)
        for rec in self._blocks:
            if (rec.status is BlockStatus.ACTIVE) != bool(rec.holders):
                raise CustodyError(
                    f"block {rec.block_id}: {rec.status.value} with {len(rec.holders)} holders"
                )
            if rec.holders != held.get(rec.block_id, set()):
                raise CustodyError(f"block {rec.block_id}: holders disagree with requests")
            if rec.status is not BlockStatus.FREE and rec.owner is None:
                raise CustodyError(f"block {rec.block_id}: {rec.status.value} without an owner")
            if rec.status is not BlockStatus.FREE and rec.owner is not None:
                tenants[rec.owner.tenant_id] += 1
        tallied: Counter[str] = Counter()
        for (tenant, status), n in self._tally.items():
            if tenant is not None and status in _HELD:
                tallied[tenant] += n
        if +tallied != +tenants:
            raise CustodyError("per-tenant block counts do not add up")
        self._check_indexes()
        if sum(self.counts().values()) != len(self._blocks):
            raise CustodyError("block states do not add up to the pool size")

    def _check_indexes(self) -> None:
        """The cached-block index, the expiry index and the running tally against the pool."""
        if self._cached != {r.block_id for r in self._blocks if r.status is BlockStatus.CACHED}:
            raise CustodyError("the cached-block index disagrees with block states")
        live = {bid for deadline, n, bid in self._expiry if self._expiry_entry.get(bid) == n}
        if set(self._expiry_entry) != self._cached or live != self._cached:
            raise CustodyError("the expiry index disagrees with the cached blocks")
        if self.summary() != summarize(self._blocks):
            raise CustodyError("the running tally disagrees with the pool")
        aged: set[tuple[str, BlockId]] = {
            (tenant, bid)
            for tenant, heap in self._by_age.items()
            for _, n, bid in heap
            if self._expiry_entry.get(bid) == n
        }
        cached = (self._blocks[b] for b in self._cached)
        owned = {(r.owner.tenant_id, r.block_id) for r in cached if r.owner is not None}
        if aged != owned:
            raise CustodyError("the per-tenant age index disagrees with the cached blocks")

    # --- internals --------------------------------------------------------------------------------

    def _set(
        self, rec: BlockRecord, status: BlockStatus, policy: TenantPolicy | None = None
    ) -> None:
        """The only place a block's status changes (keeps the tally and the cached indexes exact:
        the tally's (tenant, status) counts are what quotas and summaries read). `policy`: the
        owner's, when the caller has it at hand (a block becoming cached schedules its expiry)."""
        if status is not _QUARANTINED:
            rec.quarantined_at = None
        was = rec.status
        rec.status = status
        self._retally(rec)
        if status is _CACHED:
            self._cached.add(rec.block_id)
            self._schedule_expiry(rec, policy)
        elif was is _CACHED:
            self._cached.discard(rec.block_id)
            del self._expiry_entry[rec.block_id]

    def _cache(self, rec: BlockRecord, tenant: str, policy: TenantPolicy) -> None:
        """`_set(rec, _CACHED, policy)` for a block of `tenant`; an active one (most blocks a
        finished request leaves) in place, with the same effects."""
        if rec.status is not _ACTIVE:
            self._set(rec, _CACHED, policy)
            return
        rec.status, rec.quarantined_at = _CACHED, None
        tally, key, old = self._tally, (tenant, _CACHED), rec.tally_key
        tally[old] -= 1  # an active block is counted under (its owner, active)
        if not tally[old]:
            del tally[old]
        tally[key] += 1
        rec.tally_key = key
        self._cached.add(rec.block_id)
        self._schedule_expiry(rec, policy)

    def _retally(self, rec: BlockRecord) -> None:
        """Count the block under its current (owner tenant, status); after any change of either."""
        key = (rec.owner.tenant_id if rec.owner is not None else None, rec.status)
        old = rec.tally_key
        if key != old:
            self._tally[key] += 1
            self._tally[old] -= 1
            if not self._tally[old]:
                del self._tally[old]
            rec.tally_key = key

    def _ids(self, block_ids: Iterable[int]) -> list[BlockId]:
        """Block ids from the engine, each checked as `_check_id` does: plain ints in range (the
        engine's, every step) pass in one C-level pass; anything else goes id by id."""
        ids = list(block_ids)
        if not ids:
            return []
        if set(map(type, ids)) == _PLAIN_INT and min(ids) >= 0 and max(ids) < len(self._blocks):
            return cast("list[BlockId]", ids)  # BlockId is an int
        return [self._check_id(b) for b in ids]

    def _check_id(self, block_id: int) -> BlockId:
        if isinstance(block_id, bool) or not 0 <= block_id < len(self._blocks):
            raise CustodyError(f"block id {block_id} is out of range [0, {len(self._blocks)})")
        return BlockId(int(block_id))

    def _request(self, request_id: str) -> _Request:
        try:
            return self._requests[RequestId(request_id)]
        except KeyError:
            raise CustodyError(f"request {request_id!r} is not registered") from None

    def _needs_clear(self, rec: BlockRecord, next_scope: Scope) -> bool:
        assert rec.owner is not None
        return must_zeroize_owned(self._policy(rec.owner.tenant_id), rec.owner, next_scope)

    def _zeroize_now(self, rec: BlockRecord) -> bool:
        assert rec.owner is not None
        policy = self._policy(rec.owner.tenant_id)
        return rec.doomed or policy.zeroize.on_release is ZeroizeOn.ALWAYS

    def _keep_cached(self, rec: BlockRecord, now: float, policy: TenantPolicy) -> bool:
        """`policy`: the owner's (the block has one)."""
        if rec.doomed or not rec.retain or not rec.hashed or rec.owner is None:
            return False
        cap = policy.quota.max_blocks
        if cap is not None and self.tenant_cached(rec.owner.tenant_id) >= cap:
            return False  # a tenant's cache never grows past its quota (docs/policy.md)
        return not expired_at(policy, rec.created_at, rec.last_used_at, now)

    def _take(
        self,
        rec: BlockRecord,
        req: _Request,
        rid: RequestId,
        now: float,
        position: int | None = None,
    ) -> None:
        """`position`: the block's index in the request's block table (default: the next one)."""
        owner = rec.owner
        if rec.status is _FREE or owner is None or not owner.same_domain(req.scope):
            rec.doomed = False  # a new owner's block (a doomed request dooms it again below)
            rec.owner, rec.owner_tag = req.scope, req.tag
            limit, at = req.retain_blocks, len(req.blocks) if position is None else position
            rec.retain = req.use_cache and (limit is None or at < limit)
        self._set(rec, _ACTIVE)
        rec.holders.add(rid)
        rec.last_used_at = now
        req.blocks.append(rec.block_id)
        # A doomed request dooms its own blocks, not another member's shared prefix it reuses: the
        # purge or policy change did not select that owner, whose cache stays (found by a review:
        # a doomed request resuming after a preemption destroyed another member's group prefix).
        if req.doomed and rec.owner is not None and rec.owner.tenant_id == req.scope.tenant_id:
            self._doom(rec)

    def _engine_evicted(self, rec: BlockRecord, now: float) -> None:
        """The engine's LRU took a cached block for a new allocation: its cached life is over. The
        `block.evict` entries are batched per owner when events are next taken (once per step)."""
        self._cache_ages.append(CacheAge(CacheExit.EVICTED, now - rec.created_at))
        self._evicted.append((rec.block_id, rec.owner_tag, now))
        self._set(rec, _FREE)

    def _engine_took_quarantined(self, rec: BlockRecord) -> None:
        """The engine re-allocated a block custody had just quarantined (it freed it on a path that
        bypasses the connector, e.g. preemption) before the worker cleared it. It still holds its
        old owner's bytes, so it becomes a handover clear of this step (G3). Only a block whose
        clear is not planned yet gets here (`_check_allocatable` refused the others)."""
        self._pending_release.discard(rec.block_id)
        self._set(rec, _FREE)

    def _handover_owner(self, rec: BlockRecord) -> None:
        self._handover_from.setdefault(rec.block_id, deque()).append((rec.owner, rec.owner_tag))

    def _quarantine(self, rec: BlockRecord, now: float) -> None:
        self._set(rec, BlockStatus.QUARANTINED)
        rec.quarantined_at = now
        rec.hashed = False
        self._pending_release.add(rec.block_id)
        self._new_pending.append(rec.block_id)

    def _emit(  # noqa: PLR0917 (private, called with the event's fields in order)
        self,
        kind: EventKind,
        now: float,
        scope: Scope,
        request_id: str,
        ids: Iterable[int],
        details: Details,
    ) -> None:
        self._events.append(
            CustodyEvent(kind, now, self._tag(scope), request_id, tuple(ids), details)
        )

    def _emit_grouped(
        self,
        kind: EventKind,
        now: float,
        ids: list[int],
        details: Details,
    ) -> None:
        by_tag: dict[str | None, list[int]] = {}
        for bid in ids:
            by_tag.setdefault(self._blocks[bid].owner_tag, []).append(bid)
        for tag, group in by_tag.items():
            self._events.append(CustodyEvent(kind, now, tag, None, tuple(group), details))
