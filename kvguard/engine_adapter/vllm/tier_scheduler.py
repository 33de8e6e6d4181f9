"""The scheduler half of the offload tier: what to spill, what to restore, what must leave.

`SchedulerTier` lives beside custody in the scheduler guard and decides; the worker's `WorkerTier`
holds the ciphertexts and carries the orders out (tier_worker.py). Per step:

- **Spill.** When a request ends, its blocks that stay cached for a tenant whose policy allows
  offload become *candidates* (their engine block hash and position are noted). When vLLM later
  re-allocates a candidate that is still cached (its LRU evicted it), the block is ordered spilled:
  the worker reads it out before the step's clears. Blocks that policy retires (expiry, purge) are
  quarantined, not cached, when vLLM next takes them, so they are never spilled.
- **Restore or recompute.** `match` runs from vLLM's `get_num_new_matched_tokens`: the consecutive
  run of the request's own block hashes (salted per scope), in its own reuse domain, that the tier
  holds after the locally cached prefix. It is restored only when that is cheaper than recomputing:
  `blocks x restore_s_per_block` (measured by the worker at start, or configured) against
  `blocks x block_size x prefill_s_per_token` (measured from the engine's own steps, or configured).
  Both decisions are counted and recorded (`block.restore` with `decision`).
- **Budget, retention, purges.** The index is authoritative (`kvguard.offload.index`): over the
  engine's budget or a tenant's `offload.max_bytes`, the oldest entries are dropped; entries older
  than the tenant's `offload.ttl_s` are dropped; a domain left empty is shredded (`expiry`, or
  `emptied` by the budget, a cap or failed loads); a purge shreds every matching domain (`purge`,
  with the job's command id); a policy change shreds a domain a tenant of it is disabled in
  (`disable`), may no longer offload, may no longer reuse (new epoch, share withdrawn) or may no
  longer keep on disk (`policy`), and trims tenants over a lowered cap.

Ledger events (G5, G6: scope tags, block ids and counts only): `block.spill` per scope tag and step,
`block.restore` per request, `tier.auth_failure` when an entry fails authentication (recomputed),
`key.shred` per destroyed key.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Collection, MutableMapping
from dataclasses import dataclass, replace
from typing import Any, Final

from kvguard.engine_adapter.records import CustodyEvent, EventKind, PurgeSelector
from kvguard.engine_adapter.vllm.metadata import ShredOrder, TierOrder, TierReport
from kvguard.isolation.scope import Scope, Share
from kvguard.logging import get_logger
from kvguard.offload.index import IndexEntry, TierIndex, TierKey
from kvguard.policy import PolicySet, TenantPolicy
from kvguard.policy.decisions import expired_at, may_reuse

_log = get_logger("vllm.tier")
_EWMA: Final = 0.2
_MIN_MEASURED_TOKENS: Final = 2  # blocks' worth of tokens a step needs to count as a prefill sample
_STEP_SAMPLES: Final = 256  # recent steps the prefill slope is fitted to


@dataclass(slots=True)
class _Candidate:
    key: TierKey
    scope: Scope
    scope_tag: str
    created_at: float | None = None  # the block's cached life so far (custody's record)
    last_used_at: float | None = None


@dataclass(slots=True)
class _Match:
    start: int  # index of the first tier block in the request's block table
    keys: list[TierKey]
    scope_tag: str  # the domain's, bound into the ciphertexts
    decision: str
    tenant: str  # the requesting tenant (its metrics count the restore)
    event_tag: str  # the requesting tenant's own tag, which its ledger entries carry


@dataclass(frozen=True, slots=True)
class TierSettings:
    budget_bytes: int
    directory: str | None = None
    restore_us_per_block: float | None = None  # configured; None: measured by the worker
    prefill_us_per_token: float | None = None  # configured; None: measured from the steps


class SchedulerTier:
    def __init__(
        self,
        settings: TierSettings,
        *,
        block_size: int,
        engine_id: str,
        policies: Callable[[], PolicySet],
        tag_for: Callable[[Scope], str],
        clock: Callable[[], float] = time.time,
        member_tag_for: Callable[[Scope], str] | None = None,
        stats: MutableMapping[str, int] | None = None,
        tenant_figure: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.index = TierIndex(settings.budget_bytes)
        self._bs = block_size
        self._engine_id = engine_id
        self._policies = policies  # the policy set in force (swapped by policy commands)
        self._tag_for = tag_for  # the domain's tag, bound into the ciphertexts
        # The tag a tenant's ledger entries carry (`SaltDeriver.member_tag`): a shared domain's
        # tag names no tenant, so spills and restores are recorded under their tenant's own.
        self._member_tag_for = member_tag_for or tag_for
        self._clock = clock
        self._candidates: dict[int, _Candidate] = {}
        # Domains that may have a data key in the worker (a spill was ordered since their last
        # shred) -> the owner scopes that spilled into it, by tenant. A group or public domain is
        # shared by its tenants (its key leaves the tenant out), so a purge, disable or policy
        # change of any one of them shreds the domain (the others' entries are recomputed), and
        # each entry is charged to and expires by the tenant that spilled it (`_spilling`).
        self._scopes: dict[bytes, dict[str, Scope]] = {}
        self._spilling: dict[TierKey, str] = {}  # spills ordered, not yet reported -> tenant
        self._generation: Counter[bytes] = Counter()  # shreds so far, per domain
        self._matches: dict[str, _Match] = {}
        self._external: dict[str, int] = {}
        # block id -> (request id, tenant), loads ordered and unreported
        self._loading: dict[int, tuple[str, str, str]] = {}  # + the requester's event tag
        # Blocks a restore was ordered into -> when the restored bytes were first computed:
        # custody dates the block from then (`SchedulerGuard._allocate`), not from the restore.
        self.born: dict[int, float] = {}
        self._spill: list[TierOrder] = []
        self._load: list[TierOrder] = []
        self._drop: list[TierOrder] = []
        self._shred: list[ShredOrder] = []
        self.events: list[CustodyEvent] = []
        self.stats: MutableMapping[str, int] = Counter() if stats is None else stats
        self.restore_s_per_block = (
            None if settings.restore_us_per_block is None else settings.restore_us_per_block / 1e6
        )
        self._prefill: float | None = None  # measured, fitted on demand (`prefill_s_per_token`)
        self._fitted = True
        self._step_started: tuple[float, int] | None = None
        self._steps: deque[tuple[int, float]] = deque(maxlen=_STEP_SAMPLES)
        # (tenant, figure, amount): the per-tenant metrics (the engine reporter's `tier_figure`)
        self._tenant_figure = tenant_figure or (lambda _tenant, _figure, _amount: None)

    # --- spill ----------------------------------------------------------------------------------

    def _policy_for(self, tenant: str) -> TenantPolicy:
        return self._policies().policy_for(tenant)

    def allowed(self, tenant: str) -> bool:
        policy = self._policy_for(tenant)
        return policy.enabled and policy.offload.allowed

    def note_cached(
        self,
        request: Any,
        scope: Scope,
        block_ids: list[int],
        pool: Any,
        life: Callable[[int], tuple[float, float]] | None = None,
    ) -> None:
        """The request ended and `block_ids` stay cached: note where each belongs in the tier, and
        (`life`: block -> created, last used) how long it has lived, which its retention counts."""
        if not block_ids or not self.allowed(scope.tenant_id):
            return
        hashes = getattr(request, "block_hashes", None) or ()
        positions = {bytes(h): i for i, h in enumerate(hashes)}
        tag = self._tag_for(scope)
        for b in block_ids:
            block_hash = pool.blocks[b].block_hash
            if block_hash is None:
                continue
            raw = bytes(block_hash)[:-4]  # vLLM's hash with its 4-byte KV cache group id
            position = positions.get(raw)
            if position is not None:
                born, used = life(b) if life is not None else (None, None)
                self._candidates[b] = _Candidate(
                    TierKey(scope.domain_key, raw, position), scope, tag, born, used
                )

    def on_allocated(self, block_ids: list[int], still_cached: Callable[[int], bool]) -> None:
        """vLLM gave these blocks to a request: cached candidates among them were evicted by its LRU
        and are spilled before the clears (their bytes are intact until this step's forward).

        Not into a domain whose shred, or over a key whose drop, is already ordered for this
        step: the worker spills before it drops and shreds, so the new entry would be deleted
        while the index kept it (found by a review: the index then promised, and charged for,
        entries the worker no longer held, and a later purge's figures disagreed with its
        `key.shred`)."""
        shredding = {o.domain for o in self._shred}
        dropping = {o.key for o in self._drop}
        for b in block_ids:
            candidate = self._candidates.pop(b, None)
            if candidate is None or not still_cached(b):
                continue
            scope = candidate.scope
            if not self.allowed(scope.tenant_id):
                continue
            if scope.domain_key in shredding or candidate.key in dropping:
                continue
            disk = (
                self.settings.directory is not None
                and self._policy_for(scope.tenant_id).offload.disk
            )
            self._scopes.setdefault(scope.domain_key, {}).setdefault(scope.tenant_id, scope)
            self._spilling[candidate.key] = scope.tenant_id
            self._spill.append(
                TierOrder(
                    b,
                    candidate.key,
                    candidate.scope_tag,
                    disk,
                    self._generation[scope.domain_key],
                    candidate.created_at,
                    candidate.last_used_at,
                )
            )

    # --- restore --------------------------------------------------------------------------------

    def match(self, request: Any, scope: Scope, num_computed: int, share_tokens: int | None) -> int:
        """Tokens vLLM may load from the tier for `request` (0: none, or recompute is cheaper)."""
        rid = request.request_id
        self._matches.pop(rid, None)
        if not self.index or not self.allowed(scope.tenant_id):
            return 0
        hashes = getattr(request, "block_hashes", None) or ()
        start = num_computed // self._bs
        # vLLM computes at least the last token itself; a share group only shares its listed prefix.
        stop = (int(request.num_tokens) - 1) // self._bs
        if share_tokens is not None:
            stop = min(stop, share_tokens // self._bs)
        keys = self.index.run(scope.domain_key, hashes, start, stop)
        if keys and not self._may_serve(scope.domain_key, scope):
            return 0
        now = self._clock()
        for n, key in enumerate(keys):  # a prefix past its owner's retention is not served
            entry = self.index.get(key)
            if entry is None or self._expired(entry, now):
                keys = keys[:n]
                break
        if not keys:
            return 0
        decision, restore_s, recompute_s = self._decide(len(keys))
        match = _Match(
            start,
            keys,
            self._tag_for(scope),
            decision,
            scope.tenant_id,
            self._member_tag_for(scope),
        )
        if decision == "recompute":
            self._record_recompute(rid, match, restore_s, recompute_s)
            return 0
        self._matches[rid] = match
        return len(keys) * self._bs

    def _decide(self, blocks: int) -> tuple[str, float | None, float | None]:
        restore = None if self.restore_s_per_block is None else blocks * self.restore_s_per_block
        recompute = (
            None
            if self.prefill_s_per_token is None
            else blocks * self._bs * self.prefill_s_per_token
        )
        if restore is None or recompute is None or restore <= recompute:
            return "restore", restore, recompute  # unknown cost: the tier is the cheaper bet
        return "recompute", restore, recompute

    def _record_recompute(
        self, rid: str, match: _Match, restore_s: float | None, recompute_s: float | None
    ) -> None:
        key = f"recompute:{rid}"
        if key in self._matches:  # vLLM may ask again for a request it could not schedule yet
            return
        self._matches[key] = match
        self.stats["tier_recompute_decisions"] += 1
        self.events.append(
            CustodyEvent(
                EventKind.RESTORE,
                self._clock(),
                match.event_tag,
                rid,
                (),
                {
                    "decision": "recompute",
                    "tier_hit_block_count": len(match.keys),
                    "restore_us_estimate": _us(restore_s),
                    "recompute_us_estimate": _us(recompute_s),
                    "engine_id": self._engine_id,
                },
            )
        )

    def after_alloc(self, request: Any, block_ids: list[int], num_external: int) -> None:
        """vLLM allocated the request's blocks: order the matched entries loaded into them."""
        rid = request.request_id
        match = self._matches.pop(rid, None)
        if match is None or num_external <= 0:
            return
        count = num_external // self._bs
        for i, key in enumerate(match.keys[:count]):
            block = block_ids[match.start + i]
            self._load.append(TierOrder(block, key, match.scope_tag))
            self._loading[block] = (rid, match.tenant, match.event_tag)
            entry = self.index.get(key)
            if entry is not None and entry.created_at is not None:
                self.born[block] = entry.created_at
        self.index.touch(match.keys[:count])
        self._external[rid] = count * self._bs
        self.stats["tier_restore_decisions"] += 1

    def take_external(self, rid: str) -> int:
        """Tokens of `rid`'s computed prefix that came from the tier (custody counts them as new
        allocations, not prefix hits)."""
        return self._external.pop(rid, 0)

    def forget_request(self, rid: str) -> None:
        self._matches.pop(rid, None)
        self._matches.pop(f"recompute:{rid}", None)
        self._external.pop(rid, None)

    # --- orders and reports ---------------------------------------------------------------------

    def take_orders(
        self,
    ) -> tuple[
        tuple[TierOrder, ...], tuple[TierOrder, ...], tuple[ShredOrder, ...], tuple[TierOrder, ...]
    ]:
        """(spill, drop, shred, load) for this step's metadata."""
        out = (tuple(self._spill), tuple(self._drop), tuple(self._shred), tuple(self._load))
        self._spill, self._drop, self._shred, self._load = [], [], [], []
        return out

    def step_started(self, tokens: int) -> None:
        self._step_started = (time.perf_counter(), tokens)

    def step_finished(self) -> None:
        """Sample a step's (tokens, seconds) for the prefill cost (`prefill_s_per_token`)."""
        if self._step_started is None or self.settings.prefill_us_per_token is not None:
            return
        started, tokens = self._step_started
        self._step_started = None
        if tokens > 0:
            self._steps.append((tokens, time.perf_counter() - started))
            self._fitted = False

    @property
    def prefill_s_per_token(self) -> float | None:
        """The configured prefill cost per token, or the *marginal* one measured: the least-squares
        slope of step time over scheduled tokens in the recent steps, so a step's fixed cost (paid
        whether a request restores or recomputes) and noise spread over a small batch do not count
        as prefill. Until the steps vary enough to fit a slope, the cheapest per-token step of at
        least a few blocks stands in. Fitted when asked (a decision), not per step."""
        if self.settings.prefill_us_per_token is not None:
            return self.settings.prefill_us_per_token / 1e6
        if not self._fitted:
            self._prefill = _slope(self._steps)
            if self._prefill is None:
                big = [s / t for t, s in self._steps if t >= _MIN_MEASURED_TOKENS * self._bs]
                self._prefill = min(big) if big else None
            self._fitted = True
        return self._prefill

    def on_report(self, report: TierReport) -> None:
        now = self._clock()
        if self.settings.restore_us_per_block is None:
            if report.restore_s_per_block is not None:  # the worker's profile at start
                self.restore_s_per_block = report.restore_s_per_block
            loaded = len(report.restored) + len(report.failed)
            if loaded:  # then what restores really cost here (lookup, decrypt, copies)
                sample = report.restore_s / loaded
                old = self.restore_s_per_block
                self.restore_s_per_block = sample if old is None else old + _EWMA * (sample - old)
        self._spilled(report, now)
        self._restored(report, now)
        for done in report.shredded:
            self.stats["tier_keys_shredded"] += int(done.destroyed_epoch is not None)
            details: dict[str, str | int | float | bool | None] = {
                "engine_id": self._engine_id,
                "reason": done.order.reason,
                "entry_count": done.entries,
                "bytes_deleted": done.bytes,
            }
            if done.destroyed_epoch is not None:
                details["destroyed_epoch"] = done.destroyed_epoch
            if done.order.command_id is not None:
                details["command_id"] = done.order.command_id
            self.events.append(
                CustodyEvent(EventKind.KEY_SHRED, now, done.order.scope_tag, None, (), details)
            )

    def _spilled(self, report: TierReport, now: float) -> None:
        per_tag: dict[str, list[tuple[TierOrder, int]]] = defaultdict(list)
        evicted: list[IndexEntry] = []  # over the budget or a tenant's cap
        revoked: list[IndexEntry] = []  # written to disk after a version revoked offload.disk
        touched = {o.key.domain for o, _ in report.spilled} | {
            o.key.domain for o in report.spill_failed
        }
        for order, size in report.spilled:
            tenant = self._spilling.pop(order.key, None)
            if order.generation != self._generation[order.key.domain] or tenant is None:
                continue  # shredded after it was ordered: the worker deleted it with the domain
            entry = IndexEntry(
                order.key,
                tenant,
                order.scope_tag,
                size,
                now,
                order.to_disk,
                order.created_at,
                order.last_used_at,
            )
            policy = self._policy_for(tenant)
            if order.to_disk and not policy.offload.disk:
                # Ordered before a version revoked disk and already with the worker (vLLM's async
                # scheduling builds the next step before this report): not kept (a review). Its
                # `put` replaced any entry at the key, which leaves the index with it (a review).
                self.index.remove(order.key)
                revoked.append(entry)
                continue
            evicted.extend(self.index.add(entry, tenant_cap=policy.offload.max_bytes))
            owner = self._scopes[order.key.domain][tenant]  # the spilling tenant's scope
            per_tag[self._member_tag_for(owner)].append((order, size))
            self._tenant_figure(tenant, "tier_spilled_blocks", 1)
            self._tenant_figure(tenant, "tier_spilled_bytes", size)
        share = report.spill_s / max(1, len(report.spilled))
        for tag, items in per_tag.items():
            nbytes = sum(size for _, size in items)
            self.stats["tier_spilled_blocks"] += len(items)
            self.stats["tier_spilled_bytes"] += nbytes
            self.events.append(
                CustodyEvent(
                    EventKind.SPILL,
                    now,
                    tag,
                    None,
                    tuple(o.block_id for o, _ in items),
                    {
                        "block_count": len(items),
                        "bytes_stored": nbytes,
                        "spill_us": _us(share * len(items)),
                        "to_disk": any(o.to_disk for o, _ in items),
                        "engine_id": self._engine_id,
                    },
                )
            )
        self.stats["tier_spill_us"] += int(report.spill_s * 1e6)
        for order in report.spill_failed:  # logged in the worker; not kept
            self._spilling.pop(order.key, None)
        self._leave(evicted, "emptied", "tier_evicted_entries")
        self._leave(revoked, "policy", None)
        # A domain whose pending spills all failed holds nothing now: no key outlives its last
        # entry (found by a review: with its last entry dropped meanwhile, its key stayed live).
        # Only the orders a report answers are forgotten: under async scheduling (vLLM's default
        # on GPU) the next step's spills are already ordered when this report arrives. Only the
        # domains this report is about are looked at (not every domain, per report).
        for domain in [d for d in touched if d in self._scopes and self._emptied(d)]:
            self._shred_domain(domain, "emptied", None)

    def _restored(self, report: TierReport, now: float) -> None:
        per_request: dict[tuple[str, str], list[int]] = defaultdict(list)
        for order in report.restored:
            rid, tenant, tag = self._loading.pop(order.block_id, ("", "", order.scope_tag))
            per_request[(rid, tag)].append(order.block_id)
            if tenant:
                self._tenant_figure(tenant, "tier_restored_blocks", 1)
                self._tenant_figure(tenant, "tier_hit_tokens", self._bs)
        share = report.restore_s / max(1, len(report.restored) + len(report.failed))
        for (rid, tag), blocks in per_request.items():
            self.stats["tier_restored_blocks"] += len(blocks)
            self.stats["tier_hit_tokens"] += len(blocks) * self._bs
            self.events.append(
                CustodyEvent(
                    EventKind.RESTORE,
                    now,
                    tag,
                    rid or None,
                    tuple(blocks),
                    {
                        "decision": "restore",
                        "block_count": len(blocks),
                        "restored_token_count": len(blocks) * self._bs,
                        "restore_us": _us(share * len(blocks)),
                        "engine_id": self._engine_id,
                    },
                )
            )
        unreadable: list[IndexEntry] = []
        for order, reason in report.failed:
            rid, _tenant, tag = self._loading.pop(order.block_id, ("", "", order.scope_tag))
            failed = self.index.remove(order.key)
            if failed is not None:
                unreadable.append(failed)
            if reason == "missing":  # dropped or shredded after the match: recomputed, no harm
                self.stats["tier_load_misses"] += 1
                continue
            self.stats["tier_auth_failures"] += 1
            _log.warning(
                "offloaded block failed authentication; recomputed", scope_tag=order.scope_tag
            )
            self.events.append(
                CustodyEvent(
                    EventKind.TIER_AUTH_FAILURE,
                    now,
                    tag,
                    rid or None,
                    (order.block_id,),
                    {"reason": reason, "engine_id": self._engine_id},
                )
            )
        self.stats["tier_restore_us"] += int(report.restore_s * 1e6)
        self._leave(unreadable, "emptied", None)

    # --- retention ------------------------------------------------------------------------------

    def purge(self, selector: PurgeSelector, command_id: int | None) -> dict[str, int]:
        """Shred every domain holding entries of a scope the purge selects (a shared domain whole);
        returns the purge entry's tier figures."""
        keys = entries = nbytes = 0
        for domain, owners in list(self._scopes.items()):
            if not any(selector.matches(scope) for scope in owners.values()):
                continue
            held, size = self.index.domain_usage(domain)
            self._shred_domain(domain, "purge", command_id)
            keys, entries, nbytes = keys + 1, entries + held, nbytes + size
        for b in [b for b, c in self._candidates.items() if selector.matches(c.scope)]:
            del self._candidates[b]
        return {"tier_key_count": keys, "tier_entry_count": entries, "tier_bytes": nbytes}

    def _expired(self, entry: IndexEntry, now: float) -> bool:
        """Past the tenant's time in the tier (`offload.ttl_s` from the spill), or past its
        retention (`retention.ttl_s` / `idle_s` from the block's creation / last use): the tier
        holds a block's cached life, it does not renew it (docs/offload.md)."""
        policy = self._policy_for(entry.tenant)
        if now - entry.stored_at >= policy.offload.ttl_s:
            return True
        if entry.created_at is None or entry.last_used_at is None:
            return False
        return expired_at(policy, entry.created_at, entry.last_used_at, now)

    def sweep(self, now: float) -> None:
        self._leave(self.index.expire(now, self._expired), "expiry", "tier_expired_entries")

    def _leave(self, gone: list[IndexEntry], reason: str, stat: str | None) -> None:
        """Entries the index let go (expired, over a budget or cap, unreadable): a domain they
        leave empty is shredded (`reason`), its ciphertexts deleted with its key, so that the
        `key.shred` entry counts them and no key outlives its last entry (a tenant with `reuse:
        session` names new domains at will); the others are dropped one by one."""
        by_domain: dict[bytes, list[IndexEntry]] = defaultdict(list)
        for entry in gone:
            by_domain[entry.key.domain].append(entry)
            if stat is not None:
                self.stats[stat] += 1
        for domain, entries in by_domain.items():
            # A spill of one of these keys ordered in this step would be deleted by the drop (the
            # worker spills first) while the index kept it: it is not spilled (a review).
            self._cancel_spills({e.key for e in entries})
            if domain in self._scopes and self._emptied(domain):
                self._shred_domain(domain, reason, None)
                continue
            self._drop.extend(TierOrder(-1, e.key, e.scope_tag) for e in entries)

    def _cancel_spills(self, keys: set[TierKey]) -> None:
        if self._spill and keys:
            self._spill = [o for o in self._spill if o.key not in keys]
            for key in keys:
                self._spilling.pop(key, None)

    def _emptied(self, domain: bytes) -> bool:
        """The index holds nothing of `domain` and no spill into it awaits its report."""
        return not self.index.has_domain(domain) and not any(
            key.domain == domain for key in self._spilling
        )

    def _may_serve(self, domain: bytes, scope: Scope) -> bool:
        """Whether every tenant that spilled into `domain` still lets `scope` reuse its blocks
        (`may_reuse`, as for a prefix hit on the device): `on_policy` shreds a domain a policy
        change withdrew, and this holds the tier to it if anything is left."""
        policies = self._policies()
        return all(
            may_reuse(policies, owner, scope) for owner in self._scopes.get(domain, {}).values()
        )

    def on_policy(self, narrowed: Collection[str] = ()) -> None:
        """A new policy is in force. What it no longer allows leaves the tier now, as it leaves
        the device (`SchedulerGuard.use_policy`): a domain (a shared one whole) is shredded when a
        tenant that spilled into it is disabled (`disable`), may no longer offload, or may no
        longer reuse the domain's blocks even itself (the epoch moved on, a share withdrawn: a
        tenant that left its group or narrowed `public`; a share group in `narrowed`, one that
        no longer lists a prefix it did), or when the domain holds files on disk
        and `offload.disk` was revoked for a tenant whose entries they are (`policy`). A lowered `offload.max_bytes` drops
        the tenant's oldest entries until it is within it."""
        policies = self._policies()
        # Spills ordered in this step go to disk only if the policy in force now allows it (the
        # worker writes them after this; found by a review: a file outlived the revocation).
        self._spill = [
            replace(o, to_disk=False)
            if o.to_disk and not policies.policy_for(self._spilling.get(o.key, "")).offload.disk
            else o
            for o in self._spill
        ]
        for domain, owners in list(self._scopes.items()):
            tenants = [policies.policy_for(tenant) for tenant in owners]
            if not all(p.enabled for p in tenants):
                self._shred_domain(domain, "disable", None)
            elif (
                not all(p.offload.allowed for p in tenants)
                or not all(may_reuse(policies, owner, owner) for owner in owners.values())
                or any(o.share is Share.GROUP and o.group_id in narrowed for o in owners.values())
                or any(
                    not policies.policy_for(t).offload.disk for t in self.index.disk_tenants(domain)
                )
            ):
                self._shred_domain(domain, "policy", None)
        over: list[IndexEntry] = []
        for tenant in self.index.tenants():
            over.extend(self.index.trim(tenant, policies.policy_for(tenant).offload.max_bytes))
        self._leave(over, "emptied", "tier_evicted_entries")

    def _domain_tag(self, domain: bytes) -> str:
        """The domain's scope tag (a tag names the reuse domain, the same for each of its owners)."""
        return self._tag_for(next(iter(self._scopes[domain].values())))

    def _shred_domain(self, domain: bytes, reason: str, command_id: int | None) -> None:
        tag = self._domain_tag(domain)
        self.index.remove_domain(domain)
        self._generation[domain] += 1
        del self._scopes[domain]
        for key in [k for k in self._spilling if k.domain == domain]:
            del self._spilling[key]  # their reports are stale now (the generation moved on)
        self._shred.append(ShredOrder(domain, tag, reason, command_id))

    def has_orders(self) -> bool:
        return bool(self._spill or self._drop or self._shred or self._load)

    def closing_shreds(self, now: float) -> None:
        """The engine stops: every data key dies with the process (its epoch secrets exist only in
        memory); record that for each domain the tier still held."""
        for domain in list(self._scopes):
            held, size = self.index.domain_usage(domain)
            self.index.remove_domain(domain)
            self.events.append(
                CustodyEvent(
                    EventKind.KEY_SHRED,
                    now,
                    self._domain_tag(domain),
                    None,
                    (),
                    {
                        "engine_id": self._engine_id,
                        "reason": "shutdown",
                        "entry_count": held,
                        "bytes_deleted": size,
                    },
                )
            )
        self._scopes.clear()


def _us(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1e6)


def _slope(samples: deque[tuple[int, float]]) -> float | None:
    """Least-squares seconds per token over (tokens, seconds) samples; None when the token counts
    do not vary enough (all decode steps, say) or the fit is not positive."""
    n = len(samples)
    if n < 8:
        return None
    mean_t = sum(t for t, _ in samples) / n
    mean_s = sum(s for _, s in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var < n * 4.0:  # token counts within about +-2 of each other: no slope to fit
        return None
    slope = sum((t - mean_t) * (s - mean_s) for t, s in samples) / var
    return slope if slope > 0 else None
