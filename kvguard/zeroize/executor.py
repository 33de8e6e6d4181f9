"""`zeroize_async` and `zeroize`: clear a plan's blocks in every layer, verify per mode, give evidence.

Ordering guarantee (G3). Clearing and verification are enqueued on `stream` (default: the current
stream of the cache's device) after all work already there, and nothing else is. Any kernel enqueued
on that stream after the call, such as the next owner's forward pass, therefore sees zeros.

Two entry points, one path:

- `zeroize_async` returns as soon as the work is enqueued (issue 14): on a GPU the host never waits
  for the device, so an engine can prepare its next step while the clear runs. The verdict (which
  checked blocks were dirty) lands in pinned host memory, written by the read-back kernel itself, and
  the returned `PendingZeroize` reads it once the call's last event has completed (`poll()`, non-
  blocking). Host cost per call on the GPU path: the plan check, a `memcpy` of the ids into pinned
  memory, one host-to-device copy, two launches of already compiled kernels, three event records.
- `zeroize` is `zeroize_async` followed by `wait()` on the call's own event (never on the device) and
  `evidence()`: the evidence it returns describes work that has happened.

The torch executor (CPU caches, or no Triton) runs synchronously: its handle is complete when returned.
"""

from __future__ import annotations

import array
import ctypes
import functools
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import torch

from kvguard.zeroize import backend, triton_exec
from kvguard.zeroize.backend import MethodChoice
from kvguard.zeroize.evidence import Method, VerifyMode, ZeroizeEvidence
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.pending import COMPLETE, CallFacts, Completion, PendingZeroize, Readout
from kvguard.zeroize.plan import ZeroizePlan
from kvguard.zeroize.staging import Staging
from kvguard.zeroize.verify import DEFAULT_SAMPLE_SIZE, blocks_to_check, parse_mode

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
    """Clear every planned block in every layer of `cache`, read back per `verify`, and wait.

    Raises ZeroizeVerificationError if a checked block is not all-zero (the caller must keep it out of
    the free pool), ZeroizeError / CacheLayoutError if the plan or executor does not fit the cache.
    """
    started = time.perf_counter()
    pending = zeroize_async(
        cache, plan, stream=stream, verify=verify, sample_size=sample_size, seed=seed,
        method=method, clock=clock,
    )  # fmt: skip
    pending.wait()
    return pending.evidence(wall_time_us=(time.perf_counter() - started) * 1e6)


def zeroize_async(
    cache: KVCacheSpec,
    plan: ZeroizePlan,
    *,
    stream: torch.cuda.Stream | None = None,
    verify: VerifyMode | str = VerifyMode.SAMPLE,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int | None = None,
    method: MethodChoice = "auto",
    clock: Clock = utc_now,
) -> PendingZeroize:
    """Enqueue the clearing and read-back of `plan` on `stream`; return without waiting.

    The handle's `poll()` says (without blocking) when the device has finished; then `ok`,
    `dirty_ids` and `evidence()` answer. Errors in the plan or the executor choice raise here.
    """
    started = time.perf_counter()
    backend.check_plan(cache, plan)
    mode = parse_mode(verify)
    # The steady state of an engine: the cache's launcher exists, so no device lookups are needed.
    launch = triton_exec.built_launcher(cache)
    if launch is not None and launch.cuda and method in _TRITON_CHOICES:
        executor = Method.TRITON
    else:
        executor = backend.resolve_method(cache, method)
    checked = (
        plan.block_ids
        if mode is VerifyMode.FULL
        else blocks_to_check(plan, mode, sample_size, seed)
    )
    started_at = clock()
    if executor is Method.TRITON and plan.block_ids:
        launch = launch or triton_exec.launcher(cache)
        completion, read = _enqueue_triton(launch, plan, checked, stream)
        device = launch.device_name
    else:
        completion, read = COMPLETE, _run_now(cache, plan, checked, executor, stream)
        device = device_name(cache.device)
    facts = CallFacts(
        cache, plan, mode, executor, device, len(checked), started_at,
        (time.perf_counter() - started) * 1e6,
    )  # fmt: skip
    return PendingZeroize(facts, completion, read)


_TRITON_CHOICES = ("auto", "triton", Method.TRITON)


def _enqueue_triton(
    launch: triton_exec.Launcher,
    plan: ZeroizePlan,
    checked: Sequence[int],
    stream: torch.cuda.Stream | None,
) -> tuple[Completion, Callable[[], Readout]]:
    """The GPU path: ids into pinned memory, one upload, two launches, three events; no waiting."""
    count, check_count = len(plan.block_ids), len(checked)
    # A sample of every block is the plan itself (both sorted): check the uploaded ids in place.
    separate = 0 < check_count < count
    words = count + check_count if separate else count
    staging = launch.staging.take(words)
    staging.ids_view[:count] = array.array("q", plan.block_ids)
    if separate:
        staging.ids_view[count:words] = array.array("q", checked)
    # No zeroing here: a staging's flags are all zero whenever it is in the pool (`_read_staged`).
    handle = launch.stream_handle(stream)
    staging.upload(words, stream, handle)
    timed = bool(staging.events)
    if timed:
        staging.record(0, stream, handle)
    launch.clear(staging.device_ids_address, count, stream, handle=handle)
    if timed:
        staging.record(1, stream, handle)
    read = functools.partial(_read_staged, launch.staging.give, staging, checked)
    if not check_count:  # the clear's end event is the call's completion
        return (staging.events[1], read) if timed else (COMPLETE, read)
    check_at = staging.device_ids_address + (8 * count if separate else 0)
    launch.check(check_at, check_count, staging.flags_address, stream, handle=handle)
    if timed:
        staging.record(2, stream, handle)
        return staging.events[2], read
    return COMPLETE, read


def _read_staged(
    give: Callable[[Staging], None], staging: Staging, checked: Sequence[int]
) -> Readout:
    """The verdict of a completed GPU call; gives its buffers back to the pool."""
    dirty: tuple[int, ...] = ()
    if checked:
        flags = staging.flags_view[: len(checked)]
        raw = flags.tobytes()
        if raw.count(0) != len(raw):  # one C-level scan; ids only on failure
            dirty = tuple(b for b, flag in zip(checked, flags.tolist(), strict=True) if flag)
            ctypes.memset(staging.flags_address, 0, len(raw))  # back in the pool all-zero
    clear_us = check_us = None
    if staging.events:
        start, middle, end = staging.events
        clear_us = float(start.elapsed_time(middle)) * 1000.0
        check_us = float(middle.elapsed_time(end)) * 1000.0 if checked else None
    give(staging)
    return Readout(dirty, clear_us, check_us)


def _run_now(
    cache: KVCacheSpec,
    plan: ZeroizePlan,
    checked: Sequence[int],
    executor: Method,
    stream: torch.cuda.Stream | None,
) -> Callable[[], Readout]:
    """The torch path (and empty plans): clear and read back now, on `stream`, waiting for both."""
    with triton_exec.on_stream(cache, stream):
        clear_timer = backend.DeviceTimer(cache)
        with clear_timer:
            backend.clear(cache, plan, executor)
        check_timer = backend.DeviceTimer(cache)
        with check_timer:
            dirty = backend.find_dirty(cache, checked, executor) if checked else []
        clear_us = clear_timer.elapsed_us() if plan.block_ids else None
        check_us = check_timer.elapsed_us() if checked else None
    readout = Readout(tuple(dirty), clear_us, check_us)
    return lambda: readout


@functools.cache
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
