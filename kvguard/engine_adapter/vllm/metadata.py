"""Messages between kvguard's scheduler-side and worker-side connector halves (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvguard.offload.index import TierKey


@dataclass
class GuardStepMeta(KVConnectorMetadata):
    """Scheduler -> worker, once per step: what to clear before this step's forward pass."""

    step: int
    release: tuple[int, ...] = ()  # quarantined blocks leaving their scope for good (G2)
    handover: tuple[int, ...] = ()  # blocks given to a new scope this step (G3)
    verify: str = "sample"
    canary: tuple[int, ...] = ()  # test-only: blocks that must read all-zero before the forward
    # The offload tier (issue 15), in the worker's order: spill (before the clears), drop, shred;
    # then, in `start_load_kv`, after the clears, load.
    spill: tuple[TierOrder, ...] = ()
    drop: tuple[TierOrder, ...] = ()
    shred: tuple[ShredOrder, ...] = ()
    load: tuple[TierOrder, ...] = ()


@dataclass
class ZeroizeResult:
    blocks: tuple[int, ...]
    ok: bool
    handover: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # the tensor-parallel rank whose shard this verdict is about
    # The scheduler step whose plan ordered the clear: with (handover, blocks) it names the clear,
    # so a verdict delivered twice, or one no plan asked for, is recognised and frees nothing.
    step: int = 0


@dataclass
class GuardWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: which blocks were cleared and the evidence.

    Results may describe clears enqueued at earlier steps: the worker reads a verdict only once the
    device has finished (worker_side.py). `pending` counts the clears still on their way."""

    results: list[ZeroizeResult] = field(default_factory=list)
    pending: int = 0
    tier: TierReport | None = None  # the offload tier runs with tensor parallel 1 only

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, GuardWorkerMeta):
            return self
        return GuardWorkerMeta(
            results=[*self.results, *other.results],
            pending=self.pending + other.pending,
            tier=self.tier or other.tier,
        )


@dataclass(frozen=True, slots=True)
class TierOrder:
    """Scheduler -> worker: move one device block to or from the offload tier (or drop an entry:
    `block_id` -1). The key's domain and block hash stay in process memory, never in a log."""

    block_id: int
    key: TierKey
    scope_tag: str
    to_disk: bool = False
    generation: int = 0  # the domain's shred generation when ordered (scheduler_tier.py)
    # A spill's block: when its bytes were computed and last used (its owner's retention counts
    # from these in the tier too); carried back in the worker's report with the order.
    created_at: float | None = None
    last_used_at: float | None = None


@dataclass(frozen=True, slots=True)
class ShredOrder:
    """Scheduler -> worker: destroy a domain's data key and delete its ciphertexts."""

    domain: bytes
    scope_tag: str
    reason: str  # purge, expiry, disable, policy, shutdown
    command_id: int | None = None


@dataclass(frozen=True, slots=True)
class ShredDone:
    order: ShredOrder
    destroyed_epoch: int | None  # None: the domain had no live key (its entries were stale)
    entries: int
    bytes: int


@dataclass
class TierReport:
    """Worker -> scheduler: what the tier did since the last step."""

    spilled: list[tuple[TierOrder, int]] = field(default_factory=list)  # (order, ciphertext bytes)
    restored: list[TierOrder] = field(default_factory=list)
    failed: list[tuple[TierOrder, str]] = field(default_factory=list)  # auth, io, missing, size
    shredded: list[ShredDone] = field(default_factory=list)
    spill_s: float = 0.0
    restore_s: float = 0.0
    # Spills the worker could not store: reported like the stored ones, so the scheduler forgets
    # exactly the orders a report answers (under vLLM's async scheduling the next step's orders
    # are already out when a report arrives).
    spill_failed: list[TierOrder] = field(default_factory=list)
    # Measured once at start: seconds to decrypt and copy in one block, its plaintext bytes.
    restore_s_per_block: float | None = None
    block_bytes: int | None = None

    def __bool__(self) -> bool:
        return bool(
            self.spilled
            or self.spill_failed
            or self.restored
            or self.failed
            or self.shredded
            or self.restore_s_per_block is not None
        )
