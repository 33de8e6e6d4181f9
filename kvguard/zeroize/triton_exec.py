"""GPU executor: launch the Triton kernels of `_kernels` over a cache spec and a plan.

Triton is imported on first use, never at module import, so `import kvguard.zeroize` works on machines
without Triton or a GPU (`triton_available()` says whether this executor can run).

Launch cost. A `Launcher` holds everything about one cache that never changes between calls, computed
once (issue 14): the segment-address table (uploaded to the device once), each kernel's geometry and
grid cap, and the compiled kernels themselves. The first launch of a kernel goes through Triton's JIT
(compile, cache); every later one calls the compiled kernel's own launcher with plain integers,
skipping the JIT's argument binding and specialization lookup. The zeroization path goes further:
both kernels of a call, described for the driver (`direct`), run as one CUDA graph (`callgraph`). The kernels take addresses, not tensors, and name
their integers in `do_not_specialize`, so one compiled kernel serves every call on the cache (see
`_kernels`); a value outside the 32-bit range the kernel was compiled for goes through the JIT again.

Stream order. Both launchers enqueue on the stream they are given and never synchronize the device:
any kernel enqueued later on that stream, such as the forward pass of the block's next owner, starts
only after every planned byte is zero; work on other streams needs the usual event wait, as for any
write to the cache.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvguard.errors import ZeroizeError
from kvguard.zeroize import _driver, direct
from kvguard.zeroize.direct import DirectKernel
from kvguard.zeroize.layout import KVCacheSpec
from kvguard.zeroize.staging import StagingPool


@dataclass(frozen=True)
class Tuning:
    """Launch constants of one kernel; the defaults below come from a sweep (docs/zeroize.md)."""

    tile_bytes: int = 16384  # bytes per work item: four 128-bit accesses per thread at 8 warps
    programs_per_sm: int = 4  # persistent grid size, in programs per multiprocessor
    num_warps: int = 8


# Sweep on an H200 (2026-11-26; tiles 4-32 KiB x 2-16 programs/SM x 4/8 warps, Llama-3-8B cache,
# scattered ids): stores are fire-and-forget, so the clearing kernel is flat within noise
# (131.5-144 us for 256 blocks, 1013-1098 us for 2048) for every setting; the read-back must keep
# loads in flight and wants occupancy: at 16 KiB and 8 warps, 2 programs/SM took 148 us for 256
# blocks, 4 took 128 us, 8 took 125 us (932 us for 2048), 16 no better.
DEFAULT_TUNING = Tuning(tile_bytes=16384, programs_per_sm=4, num_warps=8)
DEFAULT_VERIFY_TUNING = Tuning(tile_bytes=16384, programs_per_sm=8, num_warps=8)
# Programs used when no GPU is present (the interpreter): small, so tests also exercise the stride.
_INTERPRETER_PROGRAMS = 3
# Integers at or above this are compiled as 64-bit values; counts stay below it, addresses above it.
_I32_LIMIT = 1 << 31


@dataclass(frozen=True)
class _Geometry:
    """Compile-time constants for one cache shape, derived from the spec."""

    word_bytes: int
    align: int
    chunk_words: int
    tile: int
    tiles_per_chunk: int

    @property
    def even(self) -> bool:
        return self.chunk_words % self.tile == 0


@functools.cache
def triton_available() -> bool:
    """True when Triton is installed (the kernels may still need a GPU or TRITON_INTERPRET=1).

    Cached: `find_spec` walks the import path, several microseconds on every zeroization otherwise.
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or deliberately blocked install
        return False


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}


@functools.cache
def _kernel_module() -> ModuleType:
    if not triton_available():
        raise ZeroizeError(
            "the Triton executor needs the `triton` package (pip install kvguard[gpu])"
        )
    from kvguard.zeroize import _kernels  # noqa: PLC0415  (guarded import: Triton is optional)

    return _kernels


def check_runnable(spec: KVCacheSpec) -> None:
    """Raise ZeroizeError unless the Triton kernels can run on this cache's device."""
    if spec.device.type == "cuda" or (spec.device.type == "cpu" and interpreting()):
        _kernel_module()
        return
    raise ZeroizeError(
        f"the Triton executor needs a CUDA tensor (or CPU tensors under TRITON_INTERPRET=1), "
        f"got device {spec.device}; use method='torch'"
    )


def geometry(spec: KVCacheSpec, tuning: Tuning = DEFAULT_TUNING) -> _Geometry:
    """Word size, alignment and tiling for `spec`: the widest accesses its addresses allow."""
    align = 16
    for value in (spec.chunk_bytes, *spec.segment_addresses):
        align = math.gcd(align, value)  # a power of two <= 16 dividing every segment start
    word = min(align, 4)
    chunk_words = spec.chunk_bytes // word
    tile = min(1 << (chunk_words - 1).bit_length(), tuning.tile_bytes // word)
    return _Geometry(word, align, chunk_words, tile, -(-chunk_words // tile))


@contextlib.contextmanager
def on_stream(spec: KVCacheSpec, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make the cache's device and `stream` current (no-op for CPU tensors)."""
    if spec.device.type != "cuda":
        yield
        return
    with torch.cuda.device(spec.device):
        chosen = stream if stream is not None else torch.cuda.current_stream(spec.device)
        with torch.cuda.stream(chosen):
            yield


@dataclass(frozen=True)
class Compiled:
    """A compiled kernel and everything its launch needs that does not change between calls."""

    tuning: Tuning
    tiles_per_chunk: int
    max_programs: int  # persistent grid size
    constants: tuple[int, ...]  # the kernel's constexpr arguments, in order
    run: Any  # Triton's launcher for the compiled kernel
    function: Any  # the CUfunction handle
    packed: Any  # Triton's packed kernel metadata
    direct: DirectKernel | None  # described for the driver (direct.py); None: no graphs


# Byte size of each kernel's own parameters as compiled for the fast path: 64-bit addresses, then
# 32-bit counts (direct.py checks them against the driver's record of the kernel).
_GRAPH_KERNELS = (
    ("zero_blocks_kernel", DEFAULT_TUNING),
    ("dirty_blocks_kernel", DEFAULT_VERIFY_TUNING),
)
_PARAMETER_SIZES = {
    "zero_blocks_kernel": (8, 8, 4, 4, 4),  # segments, blocks, num_segments, count, num_work
    "dirty_blocks_kernel": (8, 8, 8, 4, 4, 4),  # segments, blocks, flags, ...
}


class Launcher:
    """Launch state of one cache, computed once (module docstring). Get it with `launcher(spec)`."""

    def __init__(self, spec: KVCacheSpec) -> None:
        check_runnable(spec)
        # Weak: the launcher lives in a module-level table keyed by the spec, and must not keep the
        # spec (and through it the engine's cache tensors) alive.
        self._spec = weakref.ref(spec)
        self.num_segments = spec.num_segments
        self.cuda = spec.device.type == "cuda"
        self.device_index: int | None = None
        self.device_name = spec.device.type
        self._sms = _INTERPRETER_PROGRAMS
        if self.cuda:
            index = spec.device.index
            self.device_index = torch.cuda.current_device() if index is None else index
            self.device_name = torch.cuda.get_device_name(self.device_index)
            self._sms = torch.cuda.get_device_properties(self.device_index).multi_processor_count
        # A blocking upload, once: the table is then ready for every stream that uses this cache.
        self.segment_table = torch.tensor(spec.segment_addresses, dtype=torch.int64).to(spec.device)
        self.segments = self.segment_table.data_ptr()
        self.staging = StagingPool(spec.device)  # buffers of in-flight calls (staging.py)
        self._geometry: dict[Tuning, _Geometry] = {}
        # kernel name -> its compiled kernel, for the tuning it was compiled with
        self._ready: dict[str, Compiled] = {}
        # Calls go through per-staging CUDA graphs where possible (callgraph.py); tests that
        # replace `clear` or `check` turn this off so that their replacement is what runs.
        self.graphs_enabled = True
        self._capture_stream: int | None = None
        self.calls = 0  # GPU calls made, for the sampling of device timings (executor.py)

    def describes(self, spec: KVCacheSpec) -> bool:
        return self._spec() is spec

    def geometry(self, tuning: Tuning) -> _Geometry:
        geo = self._geometry.get(tuning)
        if geo is None:
            spec = self._spec()
            if spec is None:
                raise ZeroizeError("the cache this launcher was built for no longer exists")
            geo = self._geometry[tuning] = geometry(spec, tuning)
        return geo

    def stream_handle(self, stream: torch.cuda.Stream | None) -> int:
        """The raw handle of `stream`, or of the device's current stream (0 off the GPU)."""
        if not self.cuda:
            return 0
        if stream is not None:
            return int(stream.cuda_stream)
        if _current_raw_stream is not None:  # (looked up once: 0.33 against 0.12 us per call)
            return _current_raw_stream(self.device_index)  # type: ignore[no-any-return]
        return int(torch.cuda.current_stream(self.device_index).cuda_stream)

    def clear(
        self,
        blocks: int,
        count: int,
        stream: torch.cuda.Stream | None = None,
        *,
        tuning: Tuning = DEFAULT_TUNING,
        handle: int | None = None,
    ) -> None:
        """Enqueue one launch clearing the `count` block ids at address `blocks` in every segment,
        on `stream` (None: the current stream; `handle`: its raw handle, if the caller has it)."""
        if count:
            self._launch(
                "zero_blocks_kernel", (blocks,), count, stream, tuning=tuning, handle=handle
            )

    def check(
        self,
        blocks: int,
        count: int,
        flags: int,
        stream: torch.cuda.Stream | None = None,
        *,
        tuning: Tuning = DEFAULT_VERIFY_TUNING,
        handle: int | None = None,
    ) -> None:
        """Enqueue the read-back: int32 `flags[i]` (zero on entry) becomes 1 where block i is dirty."""
        if count:
            self._launch(
                "dirty_blocks_kernel", (blocks, flags), count, stream, tuning=tuning, handle=handle
            )

    def on_its_device(self) -> bool:
        """The current device is the cache's (raw launches assume its context)."""
        return self.cuda and _get_device() == self.device_index

    def graph_kernels(self, *, with_check: bool) -> tuple[Compiled, ...] | None:
        """The compiled clear (and read-back) kernels with the default tunings, described for the
        driver, when a call may go through a graph (callgraph.py) on the current device; else None."""
        if not (self.graphs_enabled and self.on_its_device()):
            return None
        found: list[Compiled] = []
        wanted = _GRAPH_KERNELS if with_check else _GRAPH_KERNELS[:1]
        for name, tuning in wanted:
            ready = self._ready.get(name)
            if ready is None or ready.direct is None or ready.tuning is not tuning:
                return None
            found.append(ready)
        return tuple(found)

    def capture_stream(self) -> int:
        """A private stream on which graphs are captured (never shared, never run on)."""
        if self._capture_stream is None:
            driver = _driver.driver()
            assert driver is not None, "graphs are only captured through the driver"
            self._capture_stream = driver.create_stream()
        return self._capture_stream

    def _launch(
        self,
        name: str,
        addresses: tuple[int, ...],
        count: int,
        stream: torch.cuda.Stream | None,
        *,
        tuning: Tuning,
        handle: int | None,
    ) -> None:
        ready = self._ready.get(name)
        if ready is not None and ready.tuning is tuning:
            num_work = self.num_segments * count * ready.tiles_per_chunk
            # Compiled for 32-bit counts and 64-bit addresses (else: the JIT, below).
            if (
                num_work < _I32_LIMIT
                and min(addresses) >= _I32_LIMIT
                and _get_device() == self.device_index
            ):
                grid = min(num_work, ready.max_programs)
                raw = self.stream_handle(stream) if handle is None else handle
                values = (self.segments, *addresses, self.num_segments, count, num_work)
                # The compiled kernel's own launcher, as Triton's JIT calls it, minus the per-call
                # argument binding (no launch metadata, no hooks: see _launch_hooks_installed).
                ready.run(grid, 1, 1, raw, ready.function, ready.packed, None, None, None,
                          *values, *ready.constants)  # fmt: skip
                return
        self._launch_jit(name, addresses, count, stream, tuning)

    def _launch_jit(
        self,
        name: str,
        addresses: tuple[int, ...],
        count: int,
        stream: torch.cuda.Stream | None,
        tuning: Tuning,
    ) -> None:
        geo = self.geometry(tuning)
        num_work = self.num_segments * count * geo.tiles_per_chunk
        max_programs = self._sms * tuning.programs_per_sm if self.cuda else self._sms
        constants = (geo.chunk_words, geo.tile, geo.tiles_per_chunk, geo.word_bytes, geo.align,
                     geo.even)  # fmt: skip
        args = (self.segments, *addresses, self.num_segments, count, num_work, *constants)
        kernel = getattr(_kernel_module(), name)
        with self._current(stream):
            result = kernel[(min(num_work, max_programs),)](*args, num_warps=tuning.num_warps)
        eligible = num_work < _I32_LIMIT and min(addresses) >= _I32_LIMIT
        if self.cuda and eligible and result is not None and not _launch_hooks_installed():
            self._ready[name] = Compiled(
                tuning, geo.tiles_per_chunk, max_programs, constants,
                result.run, result.function, result.packed_metadata,
                direct.prepare(result, _PARAMETER_SIZES[name]),
            )  # fmt: skip

    @contextlib.contextmanager
    def _current(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        with torch.cuda.device(self.device_index), torch.cuda.stream(stream):
            yield


def _launch_hooks_installed() -> bool:
    """A profiler's launch hooks (Proton) are set: keep Triton's own launch path so they see us."""
    try:
        from triton import knobs  # noqa: PLC0415  (Triton >= 3.4)
    except ImportError:
        return True
    runtime = knobs.runtime
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


def _hooked(hook: Any) -> bool:
    # Triton >= 3.6 keeps a `HookChain` that is never None: empty means no hook.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


# Private torch entry points for the two lookups every launch makes (the public wrappers build a
# Stream object, 8 us on the H100 host); the public ones where a build lacks them.
_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_LAUNCHERS: dict[int, Launcher] = {}


def launcher(spec: KVCacheSpec) -> Launcher:
    """The cache's launcher, built on first use and dropped with the spec."""
    found = _LAUNCHERS.get(id(spec))
    if found is None or not found.describes(spec):
        found = _LAUNCHERS[id(spec)] = Launcher(spec)
        weakref.finalize(spec, _LAUNCHERS.pop, id(spec), None)
    return found


def built_launcher(spec: KVCacheSpec) -> Launcher | None:
    """The cache's launcher if one was built already (a dict lookup; never builds)."""
    found = _LAUNCHERS.get(id(spec))
    return found if found is not None and found.describes(spec) else None


# --- tensor-level helpers (tests, benchmarks, verify_zeroized): the current stream ------------------


def _ids_on_device(spec: KVCacheSpec, block_ids: Sequence[int]) -> torch.Tensor:
    # A non-blocking copy from pageable memory is staged by the driver at call time, so the host
    # list may die at once; the copy itself runs in stream order.
    return torch.tensor(list(block_ids), dtype=torch.int64).to(spec.device, non_blocking=True)


def zero_blocks(
    spec: KVCacheSpec, block_ids: Sequence[int], tuning: Tuning = DEFAULT_TUNING
) -> None:
    """Enqueue one launch clearing `block_ids` in every segment, on the current stream."""
    if block_ids:
        ids = _ids_on_device(spec, block_ids)
        launcher(spec).clear(ids.data_ptr(), len(block_ids), tuning=tuning)


def dirty_flags(
    spec: KVCacheSpec, block_ids: Sequence[int], tuning: Tuning = DEFAULT_VERIFY_TUNING
) -> torch.Tensor:
    """Enqueue the read-back: an int32 flag per id, 1 where any byte is non-zero. Does not wait."""
    flags = torch.zeros(len(block_ids), dtype=torch.int32, device=spec.device)
    if block_ids:
        ids = _ids_on_device(spec, block_ids)
        launcher(spec).check(ids.data_ptr(), len(block_ids), flags.data_ptr(), tuning=tuning)
    return flags


def dirty_blocks(
    spec: KVCacheSpec, block_ids: Sequence[int], tuning: Tuning = DEFAULT_VERIFY_TUNING
) -> list[int]:
    """Ids among `block_ids` with any non-zero byte in any segment (one launch, then a read-back)."""
    if not block_ids:
        return []
    flags = dirty_flags(spec, block_ids, tuning)
    # `.tolist()` copies on the current stream and waits for it: the read-back sees the kernel's work.
    return [block for block, flag in zip(block_ids, flags.tolist(), strict=True) if flag]
