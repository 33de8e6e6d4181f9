"""The worker half of the vLLM connector: clears the step's blocks before the forward pass.

`bind_connector_metadata` runs before the model's forward pass in the same stream (vLLM's
`_get_kv_connector_output`), so a block cleared here is all-zero before any kernel of this step reads
or writes it (on GPU the zeroize kernel is enqueued on the current stream: stream order is the
guarantee). Results and evidence travel back to the scheduler in `GuardWorkerMeta`.

A handover block that fails verification is about to be written by a new owner on top of another
scope's bytes; the worker raises rather than let the forward pass run (G3, fail closed). A release
block that fails stays quarantined and is retried.
"""

from __future__ import annotations

from typing import Any

import torch

from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, GuardWorkerMeta, ZeroizeResult
from kvguard.engine_adapter.vllm.timing import PhaseTimer
from kvguard.errors import ZeroizeError, ZeroizeVerificationError
from kvguard.logging import get_logger
from kvguard.zeroize import KVCacheSpec, plan_zeroize, zeroize

_log = get_logger("vllm.worker")


class CanaryError(ZeroizeError):
    """Test-only canary: a block entering a new scope was not all-zero before the forward pass."""


class WorkerGuard:
    def __init__(self, *, canary: bool = False) -> None:
        self._spec: KVCacheSpec | None = None
        self._results: list[ZeroizeResult] = []
        self._canary = canary
        self.canary_checked = 0
        self.timer = PhaseTimer()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise ZeroizeError("vLLM registered no KV cache tensors")
        if tensors[0].device.type == "cpu":
            self._spec = KVCacheSpec.vllm_cpu(tensors)
        else:
            self._spec = KVCacheSpec.vllm_flash(tensors)
        _log.info(
            "kv caches registered",
            layers=self._spec.num_layers,
            blocks=self._spec.num_blocks,
            layout=str(self._spec.layout),
        )

    def on_step(self, meta: GuardStepMeta) -> None:
        spec = self._spec
        if spec is None:
            raise ZeroizeError(
                "kvguard worker got a zeroize plan before the KV caches were registered"
            )
        if meta.handover:
            # Raises on a failed verification: the forward pass must not run on dirty blocks.
            evidence = zeroize(spec, plan_zeroize(meta.handover, spec.num_blocks), verify="full")
            self._results.append(ZeroizeResult(meta.handover, True, True, _details(evidence)))
        if meta.release:
            try:
                evidence = zeroize(
                    spec, plan_zeroize(meta.release, spec.num_blocks), verify=meta.verify
                )
            except ZeroizeVerificationError:
                self._results.append(ZeroizeResult(meta.release, False))
            else:
                self._results.append(ZeroizeResult(meta.release, True, False, _details(evidence)))
        if meta.canary:
            self._check_canary(spec, meta.canary)

    def _check_canary(self, spec: KVCacheSpec, block_ids: tuple[int, ...]) -> None:
        for view in spec.segment_views():
            idx = torch.tensor(block_ids, dtype=torch.long, device=view.device)
            if bool(view.index_select(0, idx).any()):
                raise CanaryError(
                    f"canary: a block entering a new scope holds old bytes ({len(block_ids)} checked)"
                )
        self.canary_checked += len(block_ids)

    def take_results(self) -> GuardWorkerMeta | None:
        if not self._results:
            return None
        out, self._results = GuardWorkerMeta(results=self._results), []
        return out


def _details(evidence: Any) -> dict[str, Any]:
    return dict(evidence.as_audit_details())
