"""`KVGuardConnector`: kvguard as a vLLM v1 KV connector (one class, two roles).

vLLM builds one instance with role SCHEDULER in the engine core and one with role WORKER next to the
model runner, both from `kv_transfer_config`. The scheduler instance delegates to `SchedulerGuard`, the
worker instance to `WorkerGuard`. With an offload tier (`offload_bytes`, docs/offload.md) blocks the
device evicts are spilled encrypted and restored through vLLM's load hooks
(`get_num_new_matched_tokens`, `update_state_after_alloc`, `start_load_kv`, load errors recomputed);
without one `get_num_new_matched_tokens` returns no external tokens. The per-layer hooks do nothing.

Raw KV events carry token ids and the plain salt (ARCHITECTURE.md, engine facts): the connector refuses
to start when `kv_events_config.enable_kv_cache_events` is on (G6).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvguard.engine_adapter.vllm import lifeline
from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, GuardWorkerMeta
from kvguard.engine_adapter.vllm.routes import POOLING_REFUSED
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.engine_adapter.vllm.scheduler_side import SchedulerGuard, open_scheduler_guard
from kvguard.engine_adapter.vllm.worker_side import WorkerGuard
from kvguard.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class KVGuardConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        wrapper = _wrapping_connector()
        if wrapper is not None:
            raise ConfigError(
                f"kvguard refuses to run inside {wrapper}: the other connectors would keep or move "
                "KV state (offload tiers such as vLLM's OffloadingConnector or LMCache) that kvguard "
                "cannot see, purge or certify; configure KVGuardConnector alone (docs/offload.md)"
            )
        events = vllm_config.kv_events_config
        if events is not None and events.enable_kv_cache_events:
            raise ConfigError(
                "kvguard refuses to run with vLLM KV cache events enabled: BlockStored events carry "
                "raw token ids and the cache salt in plain text (disable kv_events_config)"
            )
        if getattr(vllm_config.model_config, "runner_type", "generate") == "pooling":
            raise ConfigError(POOLING_REFUSED)  # also a model vLLM chose to pool on its own
        parallel = vllm_config.parallel_config
        extra = dict(self._kv_transfer_config.kv_connector_extra_config)
        if extra.get("offload_bytes"):
            _check_offload(self._kv_transfer_config, parallel.tensor_parallel_size)
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "kvguard's vLLM connector supports tensor parallelism, not pipeline parallelism "
                f"(pipeline_parallel_size is {parallel.pipeline_parallel_size}; use 1)"
            )
        options = GuardOptions.from_extra_config(extra)
        lifeline.watch_parent()  # an engine child process stops when its parent is gone
        self.scheduler_guard: SchedulerGuard | None = None
        self.worker_guard: WorkerGuard | None = None
        self._worker_pending = 0  # clears the worker has enqueued but not reported yet
        self._no_tier = True
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_guard = open_scheduler_guard(
                options,
                model_name=str(vllm_config.model_config.model),
                block_size=vllm_config.cache_config.block_size,
                ranks=parallel.tensor_parallel_size,
            )
            self._s = self.scheduler_guard
            self._no_tier = self._s.tier is None  # fixed for the engine's life
        else:
            offload = None
            if options.offload_bytes > 0:
                keyring = options.deriver().keyring
                offload = (keyring, options.offload_bytes, options.offload_dir)
            cache_config = vllm_config.cache_config
            self.worker_guard = WorkerGuard(
                canary=options.canary,
                rank=_tensor_parallel_rank(),
                offload=offload,
                scheduler_blocks=lambda: getattr(cache_config, "num_gpu_blocks", None),
            )

    # --- scheduler side -------------------------------------------------------------------------

    # The scheduler role's guard, read as a plain attribute (kvguard's code runs cache-cold inside
    # the engine's step, where each call, a property's too, costs about 2 us: docs/benchmarks.md).
    # Unset in the worker role: a scheduler-side call there fails on it.
    _s: SchedulerGuard

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._s.bind_pool(gpu_block_pool)

    def on_new_request(self, request: Any) -> None:
        self._s.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # None: "not yet" - vLLM leaves the request waiting this step (a tenant over its quota).
        if not self._s.may_schedule(request):
            return None, False
        # Tokens the offload tier restores (loaded synchronously in start_load_kv), 0 without one.
        return self._s.tier_match(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        # Allocations are read from the scheduler output in build_connector_meta; only tier loads
        # need the blocks vLLM chose for them.
        self._s.tier_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._s.build_step(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._s.request_finished(request)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            self._worker_pending = 0
            if self._no_tier:
                return  # most steps: the worker cleared nothing and has nothing on its way
        else:
            self._worker_pending = meta.pending if isinstance(meta, GuardWorkerMeta) else 0
        self._s.on_worker_output(meta)

    def has_pending_push_work(self) -> bool:
        # Keeps the engine loop stepping until every quarantined block is cleared and released, and
        # until every clear the worker enqueued has reported (its evidence must reach the ledger).
        return self.scheduler_guard is not None and (
            self.scheduler_guard.has_pending() or self._worker_pending > 0
        )

    def shutdown(self) -> None:
        if self.scheduler_guard is not None:
            self.scheduler_guard.close()
        if self.worker_guard is not None:
            self.worker_guard.close()

    # --- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_guard is not None, "worker-side call on a scheduler connector"
        self.worker_guard.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_guard is not None and isinstance(connector_metadata, GuardStepMeta):
            self.worker_guard.on_step(connector_metadata)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_guard.take_results() if self.worker_guard is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self.worker_guard is not None and isinstance(meta, GuardStepMeta):
            self.worker_guard.load(meta.load)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Tier entries that failed authentication (or were gone): vLLM recomputes those blocks.
        return self.worker_guard.load_errors() if self.worker_guard is not None else set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def _check_offload(transfer: Any, tensor_parallel_size: int) -> None:
    """The offload tier needs vLLM to recompute blocks that fail to load, and one worker."""
    if transfer.kv_load_failure_policy != "recompute":
        raise ConfigError(
            "kvguard's offload tier needs kv_transfer_config.kv_load_failure_policy 'recompute' "
            "(a tier entry that fails authentication is recomputed, never served); got "
            f"{transfer.kv_load_failure_policy!r}"
        )
    if tensor_parallel_size > 1:
        raise ConfigError(
            "kvguard's offload tier supports tensor parallel 1 only (each rank would hold its own "
            f"shard of every entry); tensor_parallel_size is {tensor_parallel_size}"
        )


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM's parallel state is not set up: one worker)."""
    from vllm.distributed import parallel_state  # noqa: PLC0415

    if parallel_state.model_parallel_is_initialized():  # type: ignore[no-untyped-call]
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0


def _wrapping_connector() -> str | None:
    """The class name of a connector constructing this one (vLLM's MultiConnector builds its
    children in its own `__init__`), or None when kvguard's connector is vLLM's connector itself.
    vLLM passes a child no sign of its parent, so the constructing frames are the only witness."""
    frame = sys._getframe(2)  # the caller of KVGuardConnector.__init__, and up
    while True:
        owner = frame.f_locals.get("self")
        if isinstance(owner, KVConnectorBase_V1) and not isinstance(owner, KVGuardConnector):
            return type(owner).__name__
        if frame.f_back is None:
            return None
        frame = frame.f_back
