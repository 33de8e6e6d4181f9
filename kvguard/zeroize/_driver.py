"""The CUDA driver calls of the zeroization enqueue path, through ctypes, on raw stream, event, function
and graph handles: a host-to-device copy, event records, a kernel launch, the capture, update and
launch of a CUDA graph (callgraph.py), and look-ups made once (the device address of pinned host
memory, a kernel's parameter sizes).

Why not torch or Triton: on the H100 host of 2026-11-26 (Intel Xeon VM, torch 2.11) `Tensor.copy_`
of 512 bytes took 7.4 us of host time, `Event.record(stream)` 3.1 us and `torch.cuda.current_stream()`
8.0 us (benchmarks/zeroize_bench.py, "enqueue path pieces"), and every kernel launch 6-8 us, whoever
makes it; one `cuGraphLaunch` of both kernels took 1.7 us. Runtime (torch) and driver handles are the
same objects, so torch still owns the streams and events and Triton the compiled kernels; this module
only enqueues on them. The three calls made on every zeroization (`launch_graph`, `record`,
`set_kernel_params`) go through the C extension's trampoline (`_plan.call`) where it is built, the
others through ctypes.

Calls return the CUDA result code or check it; a failure raises `ZeroizeError` (fail closed).
`driver()` is None where `libcuda.so.1` cannot be loaded, and callers then use torch and Triton.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

from kvguard.errors import ZeroizeError

try:  # the C trampoline for the calls made on every zeroization (`_hot` below)
    from kvguard.zeroize._plan import call as _call
except ImportError:  # no C extension: ctypes makes those calls too
    _call = None  # type: ignore[assignment]

_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context is current on this thread
_MAX_PARAMETERS = 64  # far more than any kernel here takes
_INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE: e.g. a parameter index past the kernel's last

_CAPTURE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_EVENT_RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL: a record node inside a capture
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING

_c_uint = ctypes.c_uint
_c_void_p = ctypes.c_void_p


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h): a kernel node's launch, set per call on a graph."""

    _fields_ = [
        ("func", _c_void_p),
        ("grid_x", _c_uint),
        ("grid_y", _c_uint),
        ("grid_z", _c_uint),
        ("block_x", _c_uint),
        ("block_y", _c_uint),
        ("block_z", _c_uint),
        ("shared", _c_uint),
        ("params", _c_void_p),  # void **kernelParams
        ("extra", _c_void_p),
        ("kernel", _c_void_p),  # CUkernel, unused when func is set
        ("context", _c_void_p),  # CUcontext, unused when func is set
    ]


class Driver:
    def __init__(self, library: ctypes.CDLL) -> None:
        def bind(name: str, *argtypes: Any) -> Any:
            function = getattr(library, name)
            function.argtypes, function.restype = list(argtypes), ctypes.c_int
            return function

        pointer, size_p = ctypes.POINTER, ctypes.POINTER(ctypes.c_size_t)
        self._copy = bind("cuMemcpyHtoDAsync_v2", ctypes.c_uint64, _c_void_p, ctypes.c_size_t,
                          _c_void_p)  # fmt: skip
        # Per call, on raw handles (ints): `record(event, stream)` enqueues an event record and
        # returns the CUDA result code, as do `launch_graph(executable, stream)` and
        # `set_kernel_params(executable, node, params_address)` (below).
        self.record: Callable[[int, int], int] = _hot(bind("cuEventRecord", _c_void_p, _c_void_p))
        # cuLaunchKernel(CUfunction, grid x/y/z, block x/y/z, shared bytes, CUstream,
        #                void **kernelParams, void **extra)
        self._launch = bind("cuLaunchKernel", _c_void_p, *[_c_uint] * 7, _c_void_p, _c_void_p,
                            _c_void_p)  # fmt: skip
        self._host_pointer = bind("cuMemHostGetDevicePointer_v2", pointer(ctypes.c_uint64),
                                  _c_void_p, _c_uint)  # fmt: skip
        self._device_get = bind("cuDeviceGet", pointer(ctypes.c_int), ctypes.c_int)
        self._retain = bind("cuDevicePrimaryCtxRetain", pointer(_c_void_p), ctypes.c_int)
        self._set_current = bind("cuCtxSetCurrent", _c_void_p)
        self._contexts: dict[int, int] = {}  # device ordinal -> its primary context, retained once
        # Graphs (callgraph.py)
        self._record_node = bind("cuEventRecordWithFlags", _c_void_p, _c_void_p, _c_uint)
        self._begin = bind("cuStreamBeginCapture_v2", _c_void_p, ctypes.c_int)
        self._end = bind("cuStreamEndCapture", _c_void_p, pointer(_c_void_p))
        self._instantiate = bind("cuGraphInstantiateWithFlags", pointer(_c_void_p), _c_void_p,
                                 ctypes.c_ulonglong)  # fmt: skip
        self._nodes = bind("cuGraphGetNodes", _c_void_p, pointer(_c_void_p), size_p)
        self._node_type = bind("cuGraphNodeGetType", _c_void_p, pointer(ctypes.c_int))
        self._node_params = bind("cuGraphKernelNodeGetParams_v2", _c_void_p,
                                 pointer(KernelNodeParams))  # fmt: skip
        # Replace a kernel node's grid and argument values (copied now) in an instantiated graph,
        # from the KernelNodeParams at `params_address`; host-side only.
        self.set_kernel_params: Callable[[int, int, int], int] = _hot(
            bind("cuGraphExecKernelNodeSetParams_v2", _c_void_p, _c_void_p, _c_void_p)
        )
        self.launch_graph: Callable[[int, int], int] = _hot(
            bind("cuGraphLaunch", _c_void_p, _c_void_p)
        )
        self._stream_create = bind("cuStreamCreate", pointer(_c_void_p), _c_uint)
        # CUDA >= 12.4; None on older drivers (then no kernel is launched through this module).
        self._param_info = (
            bind("cuFuncGetParamInfo", _c_void_p, ctypes.c_size_t, size_p, size_p)
            if hasattr(library, "cuFuncGetParamInfo")
            else None
        )

    def copy_to_device(self, device_address: int, host_address: int, size: int, stream: int) -> int:
        """Enqueue a copy of `size` bytes of (pinned) host memory; returns the CUDA result code."""
        return int(self._copy(device_address, host_address, size, stream))

    def launch(  # noqa: PLR0917 (the driver's own argument order)
        self, function: int, grid: int, block: int, shared: int, stream: int, params: int
    ) -> int:
        """Enqueue a launch of `function` on a 1-D grid; `params` is the address of an array of
        pointers to the argument values (copied by the driver before it returns). Returns the CUDA
        result code."""
        return int(self._launch(function, grid, 1, 1, block, 1, 1, shared, stream, params, None))

    # --- graphs (callgraph.py) ---------------------------------------------------------------------

    def create_stream(self) -> int:
        """A new non-blocking stream (no implicit ordering with the legacy default stream)."""
        stream = _c_void_p(0)
        _check(self._stream_create(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return int(stream.value or 0)

    def begin_capture(self, stream: int) -> int:
        """Start capturing `stream` into a graph (thread-local mode: other threads are unaffected)."""
        return int(self._begin(stream, _CAPTURE_THREAD_LOCAL))

    def end_capture(self, stream: int) -> tuple[int, int]:
        """End the capture: (result code, graph handle)."""
        graph = _c_void_p(0)
        code = int(self._end(stream, ctypes.byref(graph)))
        return code, int(graph.value or 0)

    def record_node(self, event: int, stream: int) -> None:
        """During a capture: an event-record node (timing events work as in a stream)."""
        _check(self._record_node(event, stream, _EVENT_RECORD_EXTERNAL), "cuEventRecordWithFlags")

    def instantiate(self, graph: int) -> int:
        executable = _c_void_p(0)
        _check(self._instantiate(ctypes.byref(executable), graph, 0), "cuGraphInstantiate")
        return int(executable.value or 0)

    def kernel_nodes(self, graph: int) -> dict[int, int]:
        """The graph's kernel nodes, keyed by the function each launches."""
        count = ctypes.c_size_t(0)
        _check(self._nodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
        nodes = (_c_void_p * count.value)()
        _check(self._nodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
        found: dict[int, int] = {}
        kind, params = ctypes.c_int(0), KernelNodeParams()
        for node in nodes:
            _check(self._node_type(node, ctypes.byref(kind)), "cuGraphNodeGetType")
            if kind.value == _KERNEL_NODE:
                _check(self._node_params(node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
                found[int(params.func or 0)] = int(node or 0)
        return found

    def device_address(self, host_address: int) -> int:
        """The device's address of pinned host memory (the same number under unified addressing,
        but not always for memory registered after allocation)."""
        address = ctypes.c_uint64(0)
        _check(self._host_pointer(ctypes.byref(address), host_address, 0),
               "cuMemHostGetDevicePointer")  # fmt: skip
        return int(address.value)

    def bind_primary_context(self, device_index: int) -> None:
        """Make the device's primary context (the one torch and Triton use) current on this
        thread: a thread that never called the CUDA runtime has none, and every call above fails."""
        context = self._contexts.get(device_index)
        if context is None:
            device, handle = ctypes.c_int(0), _c_void_p(0)
            _check(self._device_get(ctypes.byref(device), device_index), "cuDeviceGet")
            _check(self._retain(ctypes.byref(handle), device.value), "cuDevicePrimaryCtxRetain")
            context = self._contexts[device_index] = int(handle.value or 0)
        _check(self._set_current(context), "cuCtxSetCurrent")

    def parameter_sizes(self, function: int) -> tuple[int, ...] | None:
        """Byte size of each parameter of a loaded kernel, in order; None if the driver cannot say."""
        if self._param_info is None:
            return None
        sizes: list[int] = []
        offset, size = ctypes.c_size_t(0), ctypes.c_size_t(0)
        while len(sizes) < _MAX_PARAMETERS:
            code = self._param_info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size))
            if code == _INVALID_VALUE:  # past the last parameter
                return tuple(sizes)
            if code != 0:
                return None
            sizes.append(int(size.value))
        return None


def _hot(function: Any) -> Callable[..., int]:
    """`function` (a bound ctypes entry point taking pointers, returning a CUresult) as a plain call
    on ints: through the C extension's trampoline when it is built, which spends about 0.05 us of
    Python around the driver call where ctypes spends 0.25-0.5 (H200 host, 2026-11-27:
    `cuEventRecord` 0.41 against 0.66 us, `cuGraphLaunch` 2.94 against 3.43 us)."""
    address = ctypes.cast(function, _c_void_p).value
    if _call is None or not address:
        return function  # type: ignore[no-any-return]
    return functools.partial(_call, address)


def _check(code: int, call: str) -> None:
    if code != 0:
        raise ZeroizeError(f"{call} failed with CUDA error {code}; nothing was cleared after it")


def check_copy(code: int) -> None:
    _check(code, "cuMemcpyHtoDAsync")


def check(code: int, call: str) -> None:
    """Raise ZeroizeError unless `code` is CUDA_SUCCESS."""
    _check(code, call)


def check_record(code: int) -> None:
    _check(code, "cuEventRecord")


def check_launch(code: int) -> None:
    _check(code, "cuLaunchKernel")


def needs_context(code: int) -> bool:
    """The calling thread has no current CUDA context (torch makes one current on first use)."""
    return code == _INVALID_CONTEXT


@functools.cache
def driver() -> Driver | None:
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):  # no NVIDIA driver here, or an unexpected one
        return None
