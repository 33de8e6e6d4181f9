"""Messages between kvguard's scheduler-side and worker-side connector halves (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class GuardStepMeta(KVConnectorMetadata):
    """Scheduler -> worker, once per step: what to clear before this step's forward pass."""

    step: int
    release: tuple[int, ...] = ()  # quarantined blocks leaving their scope for good (G2)
    handover: tuple[int, ...] = ()  # blocks given to a new scope this step (G3)
    verify: str = "sample"
    canary: tuple[int, ...] = ()  # test-only: blocks that must read all-zero before the forward


@dataclass
class ZeroizeResult:
    blocks: tuple[int, ...]
    ok: bool
    handover: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # the tensor-parallel rank whose shard this verdict is about


@dataclass
class GuardWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: which blocks were cleared and the evidence.

    Results may describe clears enqueued at earlier steps: the worker reads a verdict only once the
    device has finished (worker_side.py). `pending` counts the clears still on their way."""

    results: list[ZeroizeResult] = field(default_factory=list)
    pending: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, GuardWorkerMeta):
            return self
        return GuardWorkerMeta(
            results=[*self.results, *other.results], pending=self.pending + other.pending
        )
