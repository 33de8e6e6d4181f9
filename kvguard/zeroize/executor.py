"""`zeroize_async` and `zeroize`: clear a plan's blocks in every layer, verify per mode, give evidence.

Ordering guarantee (G3). Clearing and verification are enqueued on `stream` (default: the current
stream of the cache's device) after all work already there, and nothing else is. Any kernel enqueued
on that stream after the call, such as the next owner's forward pass, therefore sees zeros.

Two entry points, one path:

- `zeroize_async` returns as soon as the work is enqueued (issue 14): on a GPU the host never waits
  for the device, so an engine can prepare its next step while the clear runs. The verdict (which
  checked blocks were dirty) lands in pinned host memory, written by the read-back kernel itself, and
  the returned `PendingZeroize` reads it once the call's last event has completed (`poll()`, non-
  blocking). Host cost per call on the GPU path (issue 14, item 2: <= 30 us up to 64 blocks): the
  plan check, the sample draw and the ids packed into pinned memory (C, `_plan`), and one launch of
  the staging's CUDA graph holding the ids' upload, the clear, the read-back, the timing events
  when timed, and the record of the completion event (callgraph.py). The first call of a cache
  compiles the kernels and launches them one by one (as does every call where a graph cannot
  serve).
- `zeroize` is `zeroize_async` followed by `wait()` on the call's own event (never on the device) and
  `evidence()`: the evidence it returns describes work that has happened.

Device timings. A timed call brackets the clear and the read-back with three CUDA events; an untimed
call records only its completion, and its evidence says so with `device_time_us` and
`verify_time_us` None (as off the GPU), never with a guess. The verdict, the completion and every
guarantee are the same. `zeroize` times every call; `zeroize_async` by default times one GPU call in
`TIMING_EVERY` of each cache (the first included), enough for the latency metrics, and `timed=True`
or `False` decides per call.

The torch executor (CPU caches, or no Triton) runs synchronously: its handle is complete when returned.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import torch

from kvguard.zeroize import backend, callgraph, triton_exec
from kvguard.zeroize.backend import MethodChoice
from kvguard.zeroize.evidence import Method, VerifyMode, ZeroizeEvidence
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.pending import COMPLETE, CallFacts, Completion, PendingZeroize, Readout
from kvguard.zeroize.plan import ZeroizePlan
from kvguard.zeroize.staging import Staging, last_event
from kvguard.zeroize.verify import DEFAULT_SAMPLE_SIZE, blocks_to_check, parse_mode

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The default clock. `zeroize_async` reads it as `time.time()` and builds the datetime only
    for the evidence (`datetime.now(UTC)` cost 0.29 us of the enqueue on the H200 host of
    2026-11-27, `time.time()` 0.11): the same instant, from the same system clock."""
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
    timed: bool = True,
) -> ZeroizeEvidence:
    """Clear every planned block in every layer of `cache`, read back per `verify`, and wait.

    Raises ZeroizeVerificationError if a checked block is not all-zero (the caller must keep it out of
    the free pool), ZeroizeError / CacheLayoutError if the plan or executor does not fit the cache.
    """
    started = time.perf_counter()
    pending = zeroize_async(
        cache, plan, stream=stream, verify=verify, sample_size=sample_size, seed=seed,
        method=method, clock=clock, timed=timed,
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
    timed: bool | None = None,
) -> PendingZeroize:
    """Enqueue the clearing and read-back of `plan` on `stream`; return without waiting.

    The handle's `poll()` says (without blocking) when the device has finished; then `ok`,
    `dirty_ids` and `evidence()` answer. Errors in the plan or the executor choice raise here.
    `timed`: device timings in the evidence; None (the default) times one GPU call in
    `TIMING_EVERY` of the cache, the first included (module docstring).
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
    started_at = time.time() if clock is utc_now else clock()  # utc_now's docstring
    if executor is Method.TRITON and plan.block_ids:
        launch = launch or triton_exec.launcher(cache)
        if timed is None:
            timed = launch.calls % TIMING_EVERY == 0
            launch.calls += 1
        completion, read = _enqueue_triton(launch, plan, checked, stream, timed)
        device = launch.device_name
    else:  # synchronous: the timing costs nothing worth saving
        completion = COMPLETE
        read = _run_now(cache, plan, checked, executor, stream, timed=timed is not False)
        device = device_name(cache.device)
    facts = CallFacts(
        cache, plan, mode, executor, device, len(checked), started_at,
        (time.perf_counter() - started) * 1e6,
    )  # fmt: skip
    return PendingZeroize(facts, completion, read)


_TRITON_CHOICES = ("auto", "triton", Method.TRITON)
# `timed=None` times one GPU call in this many: the three timing events, as graph nodes, cost
# about 5 us of host time per call on the H100 host of 2026-11-26 (graph launch 8.7 us timed,
# 3.9 us untimed; docs/benchmarks.md, issue 14), a sixth of the 30 us budget.
TIMING_EVERY = 16


def _enqueue_triton(
    launch: triton_exec.Launcher,
    plan: ZeroizePlan,
    checked: list[int] | tuple[int, ...],
    stream: torch.cuda.Stream | None,
    timed: bool,
) -> tuple[Completion, Callable[[], Readout]]:
    """The GPU path: ids into pinned memory, then one graph launch (callgraph.py), or else the
    upload, launches and timing records one by one; then the completion record."""
    count, check_count = len(plan.block_ids), len(checked)
    # A sample of every block is the plan itself (both sorted): check the written ids in place.
    separate = 0 < check_count < count
    words = count + check_count if separate else count
    staging = launch.staging.take(words)
    staging.write_ids(plan.block_ids)
    if separate:
        staging.write_ids(checked, count)
    # No zeroing here: a staging's flags are all zero whenever it is in the pool (`_read_staged`).
    handle = launch.stream_handle(stream)
    timed = timed and bool(staging.events)
    read = functools.partial(_read_staged, launch.staging.give, staging, checked, timed)
    offset = count if separate else 0
    # Either path records the completion event, after all the call's work in stream order.
    if not callgraph.enqueue(launch, staging, count, offset, check_count, handle, timed=timed):
        _launch_each(launch, staging, (count, offset, check_count), stream, handle, timed)
    if not staging.events:  # the interpreter: the work is done
        return COMPLETE, read
    return staging.completion(last_event(timed, check_count > 0)), read


def _launch_each(  # noqa: PLR0917
    launch: triton_exec.Launcher,
    staging: Staging,
    shape: tuple[int, int, int],  # (count, where the checked ids start, check_count)
    stream: torch.cuda.Stream | None,
    handle: int,
    timed: bool,
) -> None:
    """The same work as the call's graph, completion record included, one driver call at a time."""
    count, offset, check_count = shape
    staging.upload(offset + check_count if offset else count, stream, handle)
    if timed:
        staging.record(0, stream, handle)
    launch.clear(staging.ids_address, count, stream, handle=handle)
    if check_count:
        if timed:
            staging.record(1, stream, handle)
        at = staging.ids_address + 8 * offset
        launch.check(at, check_count, staging.flags_address, stream, handle=handle)
    if staging.events:  # (none in the interpreter, whose work is done)
        staging.record(last_event(timed, check_count > 0), stream, handle)


def _read_staged(
    give: Callable[[Staging], None], staging: Staging, checked: Sequence[int], timed: bool
) -> Readout:
    """The verdict of a completed GPU call; gives its buffers back to the pool."""
    dirty: tuple[int, ...] = ()
    if checked:
        flags = staging.flags_view[: len(checked)]
        raw = flags.tobytes()
        if raw.count(0) != len(raw):  # one C-level scan; ids only on failure
            dirty = tuple(b for b, flag in zip(checked, flags.tolist(), strict=True) if flag)
            ctypes.memset(staging.flags_host_address, 0, len(raw))  # back in the pool all-zero
    clear_us = check_us = None
    if timed:
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
    *,
    timed: bool,
) -> Callable[[], Readout]:
    """The torch path (and empty plans): clear and read back now, on `stream`, waiting for both."""
    with triton_exec.on_stream(cache, stream):
        clear_timer = backend.DeviceTimer(cache)
        with clear_timer:
            backend.clear(cache, plan, executor)
        check_timer = backend.DeviceTimer(cache)
        with check_timer:
            dirty = backend.find_dirty(cache, checked, executor) if checked else []
        clear_us = clear_timer.elapsed_us() if plan.block_ids and timed else None
        check_us = check_timer.elapsed_us() if checked and timed else None
    readout = Readout(tuple(dirty), clear_us, check_us)
    return lambda: readout


@functools.cache
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
