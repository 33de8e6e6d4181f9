"""`DirectKernel`: a compiled Triton kernel described for the CUDA driver (function handle, block,
shared memory, parameter layout), with argument arrays built once and updated in place: what the
kernel nodes of a call's CUDA graph are made of (callgraph.py, issue 14, item 2).

What makes a launch by the driver equal to Triton's own, checked once when the kernel is prepared
(`prepare` returns None, and no graph is built, when anything is off):

- the parameter list: the driver's own record of the kernel's parameter sizes (`cuFuncGetParamInfo`)
  must be the sizes the caller expects (8 for an address, 4 for a count compiled as i32), followed by
  at most two 8-byte pointers: the scratch buffers Triton appends to every kernel (global scratch,
  profile scratch), passed as null because their sizes must be zero;
- the launch configuration: one CTA per cluster, no cooperative grid, no programmatic dependent
  launch, shared memory within what a plain launch allows; the block is `32 * num_warps` threads and
  the dynamic shared memory is the kernel's own figure, as Triton launches it.

A launch from Python through ctypes is no cheaper than Triton's launcher (8.9 against 8.0 us per
launch on the H100 host of 2026-11-26): the gain is in the graph, not here. The `DirectKernel` keeps
the compiled kernel alive: Triton unloads a kernel's module when its `CompiledKernel` is collected,
which would leave the function handle, and every graph node launching it, dangling.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from kvguard.zeroize import _driver

_POINTER_BYTES = 8
_SCRATCH_POINTERS = 2  # Triton's hidden trailing parameters (global and profile scratch)
_PLAIN_SHARED_LIMIT = 227 * 1024  # beyond this Triton adds a launch attribute a plain launch lacks
_CELL_TYPES = {8: ctypes.c_int64, 4: ctypes.c_int32}


class KernelArgs:
    """The argument array of one graph node: a `ctypes` cell per parameter, and an array of
    pointers to the cells, whose address is what the driver takes (it copies the values)."""

    __slots__ = ("address", "cells", "pointers")

    def __init__(self, sizes: Sequence[int], values: Sequence[int]) -> None:
        self.cells = [_CELL_TYPES[size](0) for size in sizes]  # trailing scratch pointers stay 0
        self.pointers = (ctypes.c_void_p * len(sizes))(*map(ctypes.addressof, self.cells))
        self.address = ctypes.addressof(self.pointers)
        self.update(values)

    def update(self, values: Sequence[int]) -> None:
        """Set the leading (caller's) parameters; the driver copies them at the launch."""
        for cell, value in zip(self.cells, values, strict=False):
            cell.value = value


class DirectKernel:
    """One compiled kernel and its launch configuration (module docstring)."""

    __slots__ = ("_compiled", "_driver", "block", "function", "shared", "sizes")

    def __init__(
        self, compiled: Any, driver: _driver.Driver, sizes: tuple[int, ...], block: int, shared: int
    ) -> None:
        self._compiled = compiled  # keeps the module loaded (module docstring)
        self._driver = driver
        self.function = int(compiled.function)
        self.sizes = sizes
        self.block = block
        self.shared = shared

    def args(self, values: Sequence[int]) -> KernelArgs:
        return KernelArgs(self.sizes, values)

    def launch(self, args: KernelArgs, grid: int, stream: int) -> int:
        """Enqueue one launch; returns the CUDA result code (the caller checks it)."""
        return self._driver.launch(self.function, grid, self.block, self.shared, stream,
                                   args.address)  # fmt: skip


def prepare(compiled: Any, expected: Sequence[int]) -> DirectKernel | None:
    """A `DirectKernel` for Triton's `compiled` kernel whose own parameters have byte sizes
    `expected`, or None when the raw launch cannot be shown to match Triton's (module docstring)."""
    driver = _driver.driver()
    function = getattr(compiled, "function", None)
    meta = getattr(compiled, "metadata", None)
    if driver is None or not function or meta is None or not launch_config_is_plain(meta):
        return None
    sizes = parameter_layout(driver.parameter_sizes(int(function)), expected)
    if sizes is None:
        return None
    return DirectKernel(compiled, driver, sizes, 32 * int(meta.num_warps), int(meta.shared))


def launch_config_is_plain(meta: Any) -> bool:
    """True when Triton would launch the kernel with no launch attribute and no scratch buffer."""
    try:
        num_warps, shared = int(meta.num_warps), int(meta.shared)
    except (AttributeError, TypeError, ValueError):
        return False
    return (
        num_warps > 0
        and 0 <= shared <= _PLAIN_SHARED_LIMIT
        and int(getattr(meta, "num_ctas", 1)) == 1
        and not getattr(meta, "launch_cooperative_grid", False)
        and not getattr(meta, "launch_pdl", False)
        and not getattr(meta, "global_scratch_size", 0)
        and not getattr(meta, "profile_scratch_size", 0)
    )


def parameter_layout(
    actual: Sequence[int] | None, expected: Sequence[int]
) -> tuple[int, ...] | None:
    """The sizes to build argument arrays with, if the kernel's parameters (`actual`, from the
    driver) are `expected` followed by at most two 8-byte scratch pointers; else None."""
    if actual is None:
        return None
    head, tail = tuple(actual[: len(expected)]), actual[len(expected) :]
    if head != tuple(expected) or len(tail) > _SCRATCH_POINTERS:
        return None
    if any(size != _POINTER_BYTES for size in tail):
        return None
    return tuple(actual)
