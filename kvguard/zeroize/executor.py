"""`zeroize`: clear a plan's blocks in every layer, verify per mode, return evidence.

Ordering guarantee (G3). Clearing and verification are enqueued on `stream` (default: the current
stream of the cache's device) after all work already there, and nothing else is. Any kernel enqueued
on that stream after `zeroize` is called, such as the next owner's forward pass, therefore sees zeros.
The call returns once its own work has finished on the device (it waits on its own CUDA event, never on
the whole device), so the evidence it returns describes work that has happened.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch

from kvguard.zeroize import backend, triton_exec
from kvguard.zeroize.backend import MethodChoice
from kvguard.zeroize.evidence import Method, VerifyMode, ZeroizeEvidence
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.plan import ZeroizePlan
from kvguard.zeroize.verify import (
    DEFAULT_SAMPLE_SIZE,
    blocks_to_check,
    dirty_blocks_error,
    parse_mode,
)

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


def zeroize(
    cache: KVCacheSpec,
    plan: ZeroizePlan,
    *,
    stream: torch.cuda.Stream | None = None,
    verify: VerifyMode | str = VerifyMode.SAMPLE,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int | None = None,
    method: MethodChoice = "auto",
    clock: Clock = utc_now,
) -> ZeroizeEvidence:
    """Clear every planned block in every layer of `cache`, then read back per `verify`.

    Raises ZeroizeVerificationError if a checked block is not all-zero (the caller must keep it out of
    the free pool), ZeroizeError / CacheLayoutError if the plan or executor does not fit the cache.
    """
    backend.check_plan(cache, plan)
    mode = parse_mode(verify)
    executor = backend.resolve_method(cache, method)
    checked = blocks_to_check(plan, mode, sample_size, seed)
    started_at = clock()
    outcome = _execute(cache, plan, checked, executor, stream)
    if outcome.dirty:
        _log_event(logging.ERROR, "zeroize.verify_failed",
                   dirty_count=len(outcome.dirty), checked_count=len(checked))  # fmt: skip
        raise dirty_blocks_error(outcome.dirty, len(checked), mode)
    evidence = ZeroizeEvidence(
        block_count=len(plan.block_ids),
        block_ids_sha256=plan.block_ids_digest(),
        cache_blocks=cache.num_blocks,
        layers=cache.num_layers,
        layout=str(cache.layout),
        dtype=str(cache.dtype).removeprefix("torch."),
        bytes_cleared=len(plan.block_ids) * cache.bytes_per_block,
        method=executor,
        device=device_name(cache.device),
        verify_mode=mode,
        blocks_verified=len(checked),
        verified=True if checked else None,
        device_time_us=outcome.clear_us,
        verify_time_us=outcome.check_us,
        wall_time_us=outcome.wall_us,
        timestamp=started_at,
    )
    # Debug: an engine releases blocks every step; the ledger, not the log, is the record.
    _log_event(logging.DEBUG, "zeroize.done", **evidence.as_audit_details())
    return evidence


@dataclass(frozen=True)
class _Outcome:
    dirty: list[int]
    clear_us: float | None
    check_us: float | None
    wall_us: float


def _execute(
    cache: KVCacheSpec,
    plan: ZeroizePlan,
    checked: list[int],
    executor: Method,
    stream: torch.cuda.Stream | None,
) -> _Outcome:
    """Clear, then read back `checked`, both on `stream`; wait only for this call's own events."""
    started = time.perf_counter()
    with triton_exec.on_stream(cache, stream):
        clear_timer = backend.DeviceTimer(cache)
        with clear_timer:
            backend.clear(cache, plan, executor)
        check_timer = backend.DeviceTimer(cache)
        with check_timer:
            dirty = backend.find_dirty(cache, checked, executor) if checked else []
        clear_us = clear_timer.elapsed_us() if plan.block_ids else None
        check_us = check_timer.elapsed_us() if checked else None
    return _Outcome(dirty, clear_us, check_us, (time.perf_counter() - started) * 1e6)


@functools.cache
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _log_event(level: int, event: str, **fields: Any) -> None:
    _logger()(level, event, **fields)


@functools.cache
def _logger() -> Callable[..., None]:
    # structlog is a core dependency, but GPU hosts may run this package bare (torch + Triton only);
    # the stdlib fallback keeps the executor importable and still logs the same fields there.
    try:
        from kvguard.logging import get_logger  # noqa: PLC0415
    except ImportError:
        stdlib = logging.getLogger("kvguard.zeroize")
        return lambda level, event, **fields: stdlib.log(level, "%s %s", event, fields)
    structured: Callable[..., None] = get_logger("zeroize").log
    return structured
