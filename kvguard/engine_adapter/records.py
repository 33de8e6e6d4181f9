"""Value types of the custody core: block states, per-block records, custody events, purge selectors.

Kept apart from the state machine so adapters and the ledger bridge can import them without pulling in
the engine. Nothing here holds token ids, prompt text or KV bytes (G6): a block is known by its id, its
owner scope (kept in memory only; events carry the scope tag) and its timestamps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

from kvguard.control.commands import PurgeKind, PurgeSelector
from kvguard.control.engine_metrics import CacheExit
from kvguard.isolation.scope import Scope

BlockId = NewType("BlockId", int)
RequestId = NewType("RequestId", str)


class BlockStatus(StrEnum):
    """The four custody states of a physical block (G4)."""

    FREE = "free"  # in the engine's free pool; owned by nobody
    ACTIVE = "active"  # held by at least one running request
    CACHED = "cached"  # held by no request, kept for prefix reuse inside its owner's scope
    QUARANTINED = "quarantined"  # out of the free pool until zeroized (G2)


class EventKind(StrEnum):
    """Custody transitions that may be recorded in the ledger (names match `kvguard.audit` kinds)."""

    ALLOC = "block.alloc"
    REUSE = "block.reuse"
    RELEASE = "block.release"
    EVICT = "block.evict"
    ZEROIZE = "block.zeroize"
    SESSION_PURGE = "session.purge"
    TENANT_PURGE = "tenant.purge"
    MODEL_PURGE = "model.purge"
    ADAPTER_PURGE = "adapter.purge"
    CUSTODY_REPAIR = "custody.repair"
    QUOTA_DEFER = "quota.defer"
    SPILL = "block.spill"  # cached blocks the device evicted, kept encrypted in the offload tier
    RESTORE = "block.restore"  # tier entries loaded back (or a recompute decided over a tier hit)
    KEY_SHRED = "key.shred"  # a domain's offload data key destroyed and its ciphertexts deleted
    TIER_AUTH_FAILURE = "tier.auth_failure"  # a tier entry failed authentication: recomputed


# The command vocabulary and the cache-age reasons of the metrics, re-exported for custody code.
__all__ = ["CacheExit", "PurgeKind", "PurgeSelector"]

PURGE_EVENT_KINDS: dict[PurgeKind, EventKind] = {
    PurgeKind.SESSION: EventKind.SESSION_PURGE,
    PurgeKind.TENANT: EventKind.TENANT_PURGE,
    PurgeKind.MODEL: EventKind.MODEL_PURGE,
    PurgeKind.ADAPTER: EventKind.ADAPTER_PURGE,
}


def purge_event_kind(selector: PurgeSelector) -> EventKind:
    return PURGE_EVENT_KINDS[selector.kind]


@dataclass(slots=True)
class BlockRecord:
    """What custody knows about one physical block. Mutated only by `Custody`."""

    block_id: BlockId
    status: BlockStatus = BlockStatus.FREE
    owner: Scope | None = None  # the scope whose data the block holds (None: clean)
    owner_tag: str | None = None
    hashed: bool = False  # the engine registered a prefix hash for it (reusable)
    created_at: float = 0.0
    last_used_at: float = 0.0
    holders: set[RequestId] = field(default_factory=set)
    doomed: bool = False  # purged while active: quarantine on release, never cache
    retain: bool = True  # the allocating request may keep its blocks cached
    quarantined_at: float | None = None  # when it entered quarantine (cleanup latency)
    # (owner tenant or None, status) as custody's running tally last counted it (`Custody.summary`).
    tally_key: tuple[str | None, BlockStatus] = (None, BlockStatus.FREE)

    @property
    def dirty(self) -> bool:
        """The block may hold another scope's bytes."""
        return self.owner is not None


@dataclass(slots=True)
class CustodyEvent:
    """One custody transition for the ledger. Carries tags and counts, never scopes or payloads.

    Never changed once made, though not frozen: custody makes one per request and step, and a
    frozen dataclass costs four times as much to construct (its fields are set through
    `object.__setattr__`). The evidence is the frozen `AuditEvent` the ledger builds from it."""

    kind: EventKind
    ts: float
    scope_tag: str | None
    request_id: str | None
    block_ids: tuple[int, ...]
    details: dict[str, str | int | float | bool | None]


@dataclass(frozen=True, slots=True)
class CacheAge:
    """How old a cached block's bytes were (seconds since allocation) when a prefix hit reused them or
    their cached life ended, and which of those it was. Observability only: no block id, no owner."""

    reason: CacheExit
    age_s: float


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Blocks the worker must zeroize this step, split by why (both cleared before the forward pass)."""

    release: tuple[int, ...] = ()  # quarantined blocks leaving their scope for good (G2)
    handover: tuple[int, ...] = ()  # blocks the engine re-assigned to a new scope this step (G3)

    @property
    def all_blocks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.release) | set(self.handover)))

    def __bool__(self) -> bool:
        return bool(self.release or self.handover)


@dataclass(frozen=True, slots=True)
class TenantHoldings:
    """The blocks one tenant holds now, by state, and when its oldest cached block was made."""

    active: int = 0
    cached: int = 0
    quarantined: int = 0
    oldest_cached_at: float | None = None


@dataclass(frozen=True, slots=True)
class PoolSummary:
    """Block counts of a whole pool by state and by owning tenant (what heartbeats report)."""

    free: int
    active: int
    cached: int
    quarantined: int
    residue: int  # free blocks with an old owner's bytes (`cross_scope`), cleared on handover
    tenants: dict[str, TenantHoldings]


def summarize(records: Iterable[BlockRecord]) -> PoolSummary:
    """One pass over the pool: O(blocks), no sorting (custody keeps the same figures running)."""
    counts: Counter[tuple[str | None, BlockStatus]] = Counter()
    oldest: dict[str, float] = {}
    for rec in records:
        tenant = rec.owner.tenant_id if rec.owner is not None else None
        counts[tenant, rec.status] += 1
        if (
            tenant is not None
            and rec.status is BlockStatus.CACHED
            and rec.created_at < oldest.get(tenant, float("inf"))
        ):
            oldest[tenant] = rec.created_at
    return summary_of(counts.items(), oldest.get)


_SLOT = {BlockStatus.ACTIVE: 0, BlockStatus.CACHED: 1, BlockStatus.QUARANTINED: 2}


def summary_of(
    counts: Iterable[tuple[tuple[str | None, BlockStatus], int]],
    oldest_cached: Callable[[str], float | None],
) -> PoolSummary:
    """A pool summary from block counts per (owner tenant or None, status); `oldest_cached` is
    asked only for tenants with cached blocks."""
    by_state = dict.fromkeys(BlockStatus, 0)
    residue = 0
    tally: dict[str, list[int]] = {}
    for (tenant, status), n in counts:
        by_state[status] += n
        if tenant is None:
            continue
        if status is BlockStatus.FREE:
            residue += n
            continue
        tally.setdefault(tenant, [0, 0, 0])[_SLOT[status]] += n
    return PoolSummary(
        free=by_state[BlockStatus.FREE],
        active=by_state[BlockStatus.ACTIVE],
        cached=by_state[BlockStatus.CACHED],
        quarantined=by_state[BlockStatus.QUARANTINED],
        residue=residue,
        tenants={
            t: TenantHoldings(a, c, q, oldest_cached(t) if c else None)
            for t, (a, c, q) in tally.items()
        },
    )
