"""Two CUDA driver calls for the zeroization enqueue path, through ctypes: a host-to-device copy and an
event record, on raw stream and event handles.

Why not torch: on the H100 host of 2026-11-26 (Intel Xeon, torch 2.11) `Tensor.copy_` of 512 bytes
took 7.4 us of host time, `Event.record(stream)` 3.1 us and `torch.cuda.current_stream()` 8.0 us
(benchmarks/zeroize_bench.py, "enqueue path pieces"): three records, one copy and one stream lookup
were 27 us, nearly the whole 30 us budget of a call (issue 14). The driver calls themselves cost about
a microsecond each from ctypes. Runtime (torch) and driver handles are the same objects, so torch
still owns the streams and events; this module only enqueues on them.

Every call's result code is checked; a failure raises `ZeroizeError` (fail closed). `driver()` is None
where `libcuda.so.1` cannot be loaded, and callers then use torch.
"""

from __future__ import annotations

import ctypes
import functools

from kvguard.errors import ZeroizeError

_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context is current on this thread


class Driver:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._copy = library.cuMemcpyHtoDAsync_v2
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._record = library.cuEventRecord
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._record.restype = ctypes.c_int

    def copy_to_device(self, device_address: int, host_address: int, size: int, stream: int) -> int:
        """Enqueue a copy of `size` bytes of (pinned) host memory; returns the CUDA result code."""
        return int(self._copy(device_address, host_address, size, stream))

    def record(self, event: int, stream: int) -> None:
        _check(self._record(event, stream), "cuEventRecord")


def _check(code: int, call: str) -> None:
    if code != 0:
        raise ZeroizeError(f"{call} failed with CUDA error {code}; nothing was cleared after it")


def check_copy(code: int) -> None:
    _check(code, "cuMemcpyHtoDAsync")


def needs_context(code: int) -> bool:
    """The calling thread has no current CUDA context (torch makes one current on first use)."""
    return code == _INVALID_CONTEXT


@functools.cache
def driver() -> Driver | None:
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):  # no NVIDIA driver here, or an unexpected one
        return None
