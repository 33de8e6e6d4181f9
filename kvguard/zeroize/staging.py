"""Staging buffers of in-flight zeroizations: block ids going in, verdict flags coming back.

One `Staging` serves one call of the Triton path from enqueue until its completion is observed:

- `host_ids`: the plan's block ids (and the sampled ids to check after them) in pinned host memory,
  written by one C call (`_plan.pack`; `struct.pack_into` without the extension: 0.96 against 0.47
  us for 64 ids on the H200 host of 2026-11-27, the `*ids` argument tuple included);
- where the kernels read the ids (`ids_address`): `device_ids`, filled by one stream-ordered,
  non-blocking copy (the first node of the call's graph, or `upload`); or, for a staging of at most
  `host_ids_max` ids (0 by default: measured slower on the GPU), the pinned buffer itself, which the
  GPU then reads in place (pinned memory is mapped into its address space;
  `cuMemHostGetDevicePointer` gives the address);
- `flags`: one int32 per checked block in pinned host memory, all zero whenever the staging is in
  the pool (created zeroed; the reader zeroes any flag it found set), written directly by the
  read-back kernel, so reading the verdict needs no device-to-host copy and no wait: once the call's
  last event has completed, the flags are final;
- `events`: three timing events (before the clear, between clear and read-back, after the read-back;
  the last one recorded marks a timed call's completion), and `done`, an event without timing that
  marks an untimed call's completion;
- `graphs`: the CUDA graphs of this staging's calls, one per call shape, captured on first use and
  updated in place after that (callgraph.py).

Ownership. A `StagingPool` per cache hands a staging out to one call and takes it back only when that
call's completion has been observed (`PendingZeroize` gives it back), so the GPU never reads ids or
writes flags in a buffer the host is filling for another call, on any stream; the same holds for the
graphs. The pool also keeps every staging it made: the copy and the kernels use raw addresses
that torch's allocators know nothing about, so a buffer must never be freed while the GPU may still
use it. A handle dropped before completion therefore keeps its staging out of the pool for good (the
worker never drops one).

Off the GPU (the Triton interpreter) the "device" buffers are the host ones and there are no events.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import torch

from kvguard.zeroize import _driver

try:
    from kvguard.zeroize._plan import pack as _pack
except ImportError:  # no C extension: struct below
    _pack = None  # type: ignore[assignment]

_MIN_CAPACITY = 64  # ids per staging, at least: one size serves every small release
DONE = 3  # `record` index of the untimed completion event
# Stagings of at most this many ids let the kernels read the ids from pinned host memory (no copy).
# Off by default: on the H100 host of 2026-11-26 reading in place cost the GPU more than the copy,
# which rides in the call's graph for no host time (one call of 1 / 16 / 64 blocks, verify full:
# 35.6 / 78.6 / 136.8 us of device time in place, 9.0 / 23.9 / 102.3 us copied; docs/benchmarks.md).
DEFAULT_HOST_IDS_MAX = 0


class Staging:
    """Buffers and events for one in-flight call (module docstring)."""

    __slots__ = (
        "capacity",
        "cuda",
        "device_ids",
        "device_index",
        "done",
        "done_handle",
        "event_handles",
        "events",
        "flags",
        "flags_address",
        "flags_host_address",
        "flags_view",
        "graphs",
        "host_ids",
        "host_ids_address",
        "ids_address",
        "ids_bytes",
        "on_host",
    )

    def __init__(self, device: torch.device, capacity: int, host_ids_max: int = 0) -> None:
        cuda = device.type == "cuda"
        self.cuda = _driver.driver() if cuda else None  # None: torch's calls instead
        self.capacity = capacity
        self.device_index = _index(device) if cuda else None
        self.host_ids = torch.zeros(capacity, dtype=torch.int64, pin_memory=cuda)
        self.flags = torch.zeros(capacity, dtype=torch.int32, pin_memory=cuda)
        self.host_ids_address = self.host_ids.data_ptr()
        # Ids read in place need the driver to name their device address.
        self.on_host = cuda and self.cuda is not None and capacity <= host_ids_max
        self.device_ids = self.host_ids.to(device) if cuda and not self.on_host else self.host_ids
        self.ids_address = self.device_ids.data_ptr()
        self.flags_host_address = self.flags.data_ptr()
        self.flags_address = self.flags_host_address  # where the read-back kernel writes them
        # Typed views over the tensors' memory; the tensors above keep it alive.
        self.ids_bytes = _bytes(self.host_ids_address, 8 * capacity)
        self.flags_view = _bytes(self.flags_host_address, 4 * capacity).cast("i")
        self.graphs: dict[tuple[bool, bool], Any] = {}  # (reads back, timed) -> CallGraph or None
        self.events: tuple[torch.cuda.Event, ...] = ()
        self.done: torch.cuda.Event | None = None
        self.done_handle = 0
        self.event_handles: tuple[int, ...] = ()  # raw handles, for the driver path (_driver.py)
        if cuda:
            self.events = tuple(
                torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                for _ in range(3)
            )
            self.done = torch.cuda.Event(enable_timing=False)  # type: ignore[no-untyped-call]
            with torch.cuda.device(device):
                for event in (*self.events, self.done):
                    event.record()  # torch creates the CUDA event on its first record
            handles = tuple(
                int(getattr(event, "cuda_event", 0) or 0) for event in (*self.events, self.done)
            )
            self.event_handles = handles[:3] if all(handles) else ()
            self.done_handle = handles[3]
            if self.cuda is not None:  # (after the records above: this thread has a context now)
                self.flags_address = self.cuda.device_address(self.flags_host_address)
                if self.on_host:
                    self.ids_address = self.cuda.device_address(self.host_ids_address)

    def write_ids(self, ids: list[int] | tuple[int, ...], at: int = 0) -> None:
        """Write `ids` as int64 from word `at` of the pinned buffer (one C-level conversion)."""
        if _pack is None or not _pack(self.ids_bytes, ids, at):
            struct.pack_into(f"{len(ids)}q", self.ids_bytes, 8 * at, *ids)

    def upload(self, words: int, stream: torch.cuda.Stream | None, handle: int) -> None:
        """Enqueue the copy of the first `words` ids to the device (nothing to do when the kernels
        read them in place, or off the GPU).

        `stream` is the caller's explicit stream (None: the current one, whose raw handle is
        `handle`). Through the driver when it is loaded (_driver.py), else through torch.
        """
        if self.on_host or not self.events:
            return
        cuda = self.cuda
        if cuda is not None:
            code = cuda.copy_to_device(self.ids_address, self.host_ids_address, 8 * words, handle)
            if _driver.needs_context(code):  # a thread that never used CUDA before
                self.bind_context()
                code = cuda.copy_to_device(
                    self.ids_address, self.host_ids_address, 8 * words, handle
                )
            _driver.check_copy(code)
            return
        with torch.cuda.stream(stream):  # a None stream changes nothing: the current one
            self.device_ids[:words].copy_(self.host_ids[:words], non_blocking=True)

    def record(self, index: int, stream: torch.cuda.Stream | None, handle: int) -> None:
        """Record event `index` (0: before the clear, 1: after it, 2: after the read-back, 3: the
        untimed completion `done`)."""
        cuda = self.cuda
        if cuda is not None and self.event_handles:
            event = self.done_handle if index == DONE else self.event_handles[index]
            code = cuda.record(event, handle)
            if _driver.needs_context(code):  # a thread that never used CUDA before
                self.bind_context()
                code = cuda.record(event, handle)
            _driver.check_record(code)
        else:
            self.completion(index).record(stream)

    def completion(self, index: int) -> torch.cuda.Event:
        """The event recorded as `index` (see `record`)."""
        if index == DONE:
            assert self.done is not None, "only a CUDA staging has events"
            return self.done
        return self.events[index]

    def bind_context(self) -> None:
        """Make the device's primary context current on this thread (it had none)."""
        assert self.cuda is not None and self.device_index is not None, "a CUDA staging only"
        self.cuda.bind_primary_context(self.device_index)


def last_event(timed: bool, reads_back: bool) -> int:
    """The `record` index of a call's completion: the last timing event of a timed call (2 after a
    read-back, 1 after a lone clear), else the untimed `done`."""
    if not timed:
        return DONE
    return 2 if reads_back else 1


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _bytes(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


class StagingPool:
    """Stagings of one cache, reused once their call has completed (module docstring)."""

    def __init__(self, device: torch.device, host_ids_max: int = DEFAULT_HOST_IDS_MAX) -> None:
        self._device = device
        self.host_ids_max = host_ids_max  # see Staging.on_host
        self._free: dict[int, list[Staging]] = {}
        self._made: list[Staging] = []  # every staging, so none is freed under the GPU

    def take(self, words: int) -> Staging:
        """A staging with room for `words` ids: capacities are powers of two from 64."""
        capacity = max(_MIN_CAPACITY, 1 << max(0, words - 1).bit_length())
        free = self._free.get(capacity)
        if free:
            return free.pop()
        staging = Staging(self._device, capacity, self.host_ids_max)
        self._made.append(staging)
        return staging

    def give(self, staging: Staging) -> None:
        """Take back a staging whose call has completed on the device."""
        self._free.setdefault(staging.capacity, []).append(staging)

    def free_count(self) -> int:
        return sum(len(free) for free in self._free.values())
