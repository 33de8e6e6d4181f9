"""Choosing and calling an executor: the Triton kernel on a GPU, torch everywhere else.

`auto` picks Triton for CUDA caches when Triton is installed, torch otherwise, so CPU machines need no
configuration. Naming `triton` on a CPU cache is allowed only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvguard.errors import ZeroizeError
from kvguard.zeroize import torch_exec, triton_exec
from kvguard.zeroize.evidence import Method
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.plan import ZeroizePlan

MethodChoice = Literal["auto", "triton", "torch"] | Method


def resolve_method(spec: KVCacheSpec, method: MethodChoice) -> Method:
    """The executor that will run for `spec`; raises ZeroizeError if the named one cannot."""
    if method == "auto":
        if spec.device.type == "cuda" and triton_exec.triton_available():
            return Method.TRITON
        return Method.TORCH
    try:
        chosen = Method(method)
    except ValueError:
        raise ZeroizeError(f"method must be 'auto', 'triton' or 'torch', got {method!r}") from None
    if chosen is Method.TRITON:
        triton_exec.check_runnable(spec)
    return chosen


def clear(spec: KVCacheSpec, plan: ZeroizePlan, method: Method) -> None:
    """Enqueue the clearing of every planned block on the current stream."""
    if method is Method.TRITON:
        triton_exec.zero_blocks(spec, plan.block_ids)
    else:
        torch_exec.zero_blocks(spec, plan.runs, plan.block_ids)


def find_dirty(spec: KVCacheSpec, block_ids: Sequence[int], method: Method) -> list[int]:
    """Ids among `block_ids` that hold any non-zero byte; waits for the read-back."""
    if method is Method.TRITON:
        return triton_exec.dirty_blocks(spec, block_ids)
    return torch_exec.dirty_blocks(spec, block_ids)


def check_plan(spec: KVCacheSpec, plan: ZeroizePlan) -> None:
    """A plan names blocks of one cache size; using it on another could clear the wrong bytes."""
    if not isinstance(plan, ZeroizePlan):
        raise ZeroizeError(f"expected a ZeroizePlan from plan_zeroize(), got {type(plan).__name__}")
    if plan.num_blocks != spec.num_blocks:
        raise ZeroizeError(
            f"the plan was made for a cache of {plan.num_blocks} blocks, this cache has "
            f"{spec.num_blocks}; build it with plan_zeroize(ids, spec.num_blocks)"
        )
    ids = plan.block_ids
    # A plan built by hand, not by plan_zeroize: an id past the cache made the Triton kernel clear
    # whatever memory follows the layer tensor, and the torch path clear nothing while its
    # evidence counted the block (found by a review). Two C-level passes.
    if ids and (min(ids) < 0 or max(ids) >= spec.num_blocks):
        raise ZeroizeError(
            f"the plan names a block outside the cache's range [0, {spec.num_blocks}); "
            "build it with plan_zeroize(ids, spec.num_blocks)"
        )


class DeviceTimer:
    """CUDA events around work enqueued on the current stream; nothing (None) off the GPU."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if spec.device.type == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
                torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
            )

    def __enter__(self) -> DeviceTimer:
        if self._events is not None:
            self._events[0].record()
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._events is not None:
            self._events[1].record()

    def elapsed_us(self) -> float | None:
        """Device time between the two events; waits for the end event only, not the device."""
        if self._events is None:
            return None
        start, end = self._events
        end.synchronize()
        return float(start.elapsed_time(end)) * 1000.0
