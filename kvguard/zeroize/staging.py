"""Staging buffers of in-flight zeroizations: block ids going in, verdict flags coming back.

One `Staging` serves one call of the Triton path from enqueue until its completion is observed:

- `host_ids`: the plan's block ids (and the sampled ids to check after them) in pinned host memory,
  written through a memoryview (one `memcpy`, no tensor op), then copied to `device_ids` by one
  stream-ordered, non-blocking copy;
- `flags`: one int32 per checked block in pinned host memory, all zero whenever the staging is in
  the pool (created zeroed; the reader zeroes any flag it found set), written directly by the
  read-back kernel (pinned memory is mapped into the GPU's address space
  under unified addressing), so reading the verdict needs no device-to-host copy and no wait: once the
  call's last event has completed, the flags are final;
- `events`: three timing events (before the clear, between clear and read-back, after the read-back).

Ownership. A `StagingPool` per cache hands a staging out to one call and takes it back only when that
call's completion has been observed (`PendingZeroize` gives it back), so the GPU never reads ids or
writes flags into a buffer the host is filling for another call, on any stream. The pool also keeps
every staging it made: the copy and the kernels use raw addresses that torch's allocators know
nothing about, so a buffer must never be freed while the GPU may still use it. A handle dropped
before completion therefore keeps its staging out of the pool for good (the worker never drops one).

Off the GPU (the Triton interpreter) the "device" buffers are the host ones and there are no events.
"""

from __future__ import annotations

import ctypes

import torch

from kvguard.zeroize import _driver

_MIN_CAPACITY = 64  # ids per staging, at least: one size serves every small release


class Staging:
    """Buffers and events for one in-flight call (module docstring)."""

    __slots__ = (
        "capacity",
        "cuda",
        "device_ids",
        "device_ids_address",
        "event_handles",
        "events",
        "flags",
        "flags_address",
        "flags_view",
        "host_ids",
        "host_ids_address",
        "ids_view",
    )

    def __init__(self, device: torch.device, capacity: int) -> None:
        cuda = device.type == "cuda"
        self.cuda = _driver.driver() if cuda else None  # None: torch's calls instead
        self.capacity = capacity
        self.host_ids = torch.zeros(capacity, dtype=torch.int64, pin_memory=cuda)
        self.flags = torch.zeros(capacity, dtype=torch.int32, pin_memory=cuda)
        self.device_ids = self.host_ids.to(device) if cuda else self.host_ids
        self.device_ids_address = self.device_ids.data_ptr()
        self.host_ids_address = self.host_ids.data_ptr()
        self.flags_address = self.flags.data_ptr()
        # Typed views over the tensors' memory; the tensors above keep it alive.
        self.ids_view = _bytes(self.host_ids_address, 8 * capacity).cast("q")
        self.flags_view = _bytes(self.flags_address, 4 * capacity).cast("i")
        self.events: tuple[torch.cuda.Event, ...] = ()
        self.event_handles: tuple[int, ...] = ()  # raw handles, for the driver path (_driver.py)
        if cuda:
            self.events = tuple(
                torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                for _ in range(3)
            )
            with torch.cuda.device(device):
                for event in self.events:
                    event.record()  # torch creates the CUDA event on its first record
            handles = tuple(int(getattr(event, "cuda_event", 0) or 0) for event in self.events)
            self.event_handles = handles if all(handles) else ()

    def upload(self, words: int, stream: torch.cuda.Stream | None, handle: int) -> None:
        """Enqueue the copy of the first `words` ids to the device (nothing to do off the GPU).

        `stream` is the caller's explicit stream (None: the current one, whose raw handle is
        `handle`). Through the driver when it is loaded (_driver.py), else through torch.
        """
        if not self.events:
            return
        cuda = self.cuda
        if cuda is not None:
            code = cuda.copy_to_device(
                self.device_ids_address, self.host_ids_address, 8 * words, handle
            )
            if _driver.needs_context(code):  # a thread torch never used: make its context current
                torch.cuda.set_device(self.device_ids.device)
                code = cuda.copy_to_device(
                    self.device_ids_address, self.host_ids_address, 8 * words, handle
                )
            _driver.check_copy(code)
            return
        with torch.cuda.stream(stream):  # a None stream changes nothing: the current one
            self.device_ids[:words].copy_(self.host_ids[:words], non_blocking=True)

    def record(self, index: int, stream: torch.cuda.Stream | None, handle: int) -> None:
        """Record event `index` (0: before the clear, 1: after it, 2: after the read-back)."""
        if self.cuda is not None and self.event_handles:
            self.cuda.record(self.event_handles[index], handle)
        else:
            self.events[index].record(stream)


def _bytes(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


class StagingPool:
    """Stagings of one cache, reused once their call has completed (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._free: dict[int, list[Staging]] = {}
        self._made: list[Staging] = []  # every staging, so none is freed under the GPU

    def take(self, words: int) -> Staging:
        """A staging with room for `words` ids: capacities are powers of two from 64."""
        capacity = max(_MIN_CAPACITY, 1 << max(0, words - 1).bit_length())
        free = self._free.get(capacity)
        if free:
            return free.pop()
        staging = Staging(self._device, capacity)
        self._made.append(staging)
        return staging

    def give(self, staging: Staging) -> None:
        """Take back a staging whose call has completed on the device."""
        self._free.setdefault(staging.capacity, []).append(staging)

    def free_count(self) -> int:
        return sum(len(free) for free in self._free.values())
