"""`CallGraph`: one zeroization call (clear, read-back, their timing events, the ids' upload) as a
CUDA graph, enqueued with one driver call.

Why (issue 14, item 2). On the H100 hosts of 2026-11-26 every kernel launch cost 5.5-8 us of host
time, through Triton's launcher or the driver alike, so the two launches of a call were half of the
30 us budget on their own. The same two kernels as one instantiated graph launched in 1.7 us (5.7 us
with three timing events as nodes), and replacing a kernel node's grid and arguments in the
instantiated graph cost 1.1 us, on the host only (docs/benchmarks.md, "One CUDA graph per call").

One graph per staging and call shape, captured on the first call of that shape and kept with the
staging (staging.py): its kernel nodes read the staging's ids and write its flags, and the pool hands
a staging to one call at a time, so a graph never runs twice at once and its nodes are updated only
while it is idle. Each later call sets the arguments that changed (counts, work items, grid, where
the checked ids start) and launches the graph on the caller's stream, in stream order like any launch
(G3). A staging whose ids are copied (more than the kernels read in place) carries the copy as the
graph's first node, of the whole buffer, so it never changes.

The call's completion event rides in the graph (third pass of issue 14, item 2): its last node
records the event `poll()` and `wait()` ask, `done` for an untimed call, the last timing event for a
timed one, so a call makes one driver call after packing its ids. The capture is one linear chain
and the graph starts after everything before it on the stream, so that node completes exactly when
a record on the stream after the graph would: `poll()` means the same. On the H200 host of
2026-11-27 (us, loop / right after a sync): untimed graph with its `done` node 3.95 / 7.07 against
6.82 / 8.41 for the graph and a separate `cuEventRecord`; timed, the three timing events as nodes
(the last the completion) 13.28 / 12.78 against 13.71 / 14.49 with the separate record. Recording the
first and last timing events on the stream around a graph holding only the middle one measured
9.46 / 15.89: no better right after a sync, where a timing event's record alone took 2.6 us, so the
timing events stay nodes. (In the bench, on another lease that day, the timed graph, the same
graph as before, launched in 11.35 / 13.56 us against 13.06 / 9.62 plus the record before this
change: the slower launch right after a sync is not explained; docs/benchmarks.md, third pass.)
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

from kvguard.errors import ZeroizeError
from kvguard.zeroize import _driver, _log
from kvguard.zeroize.direct import DirectKernel
from kvguard.zeroize.staging import DONE, last_event

if TYPE_CHECKING:
    from kvguard.zeroize.staging import Staging
    from kvguard.zeroize.triton_exec import Compiled, Launcher

_I32_LIMIT = 1 << 31  # the kernels were compiled for 32-bit counts and 64-bit addresses


class _Node:
    """One kernel node: its argument array and launch record, and the count it holds now.

    Arguments (the kernels' own order): segments, blocks, [flags,] num_segments, count, num_work.
    Only `count`, `num_work`, the grid and (for the read-back) `blocks` change between calls."""

    __slots__ = ("args", "blocks", "cells", "count", "handle", "kernel", "max_programs", "params",
                 "params_address", "tiles")  # fmt: skip

    def __init__(self, kernel: DirectKernel, ready: Compiled, values: tuple[int, ...], grid: int):
        self.kernel = kernel
        self.args = kernel.args(values)
        cells = self.args.cells
        self.cells = (
            cells[1],
            cells[len(values) - 2],
            cells[len(values) - 1],
        )  # blocks, count, work
        self.params = _driver.KernelNodeParams(
            func=kernel.function, grid_x=grid, grid_y=1, grid_z=1, block_x=kernel.block,
            block_y=1, block_z=1, shared=kernel.shared, params=self.args.address,
        )  # fmt: skip
        self.params_address = ctypes.addressof(self.params)
        self.handle = 0
        self.blocks, self.count = values[1], values[-2]
        self.tiles = values[-3] * ready.tiles_per_chunk  # work items per block
        self.max_programs = ready.max_programs

    def set(self, executable: int, driver: _driver.Driver, blocks: int, count: int) -> None:
        """Point the node at `count` ids from address `blocks` (copied into the graph now)."""
        blocks_cell, count_cell, work_cell = self.cells
        work = self.tiles * count
        blocks_cell.value = blocks
        count_cell.value = count
        work_cell.value = work
        self.params.grid_x = min(work, self.max_programs)
        code = driver.set_kernel_params(executable, self.handle, self.params_address)
        if code:
            _driver.check(code, "cuGraphExecKernelNodeSetParams")
        self.blocks, self.count = blocks, count


class CallGraph:
    """An instantiated graph of one staging and call shape (module docstring)."""

    __slots__ = ("_check", "_clear", "_driver", "_executable", "_graph", "_launch", "max_count")

    def __init__(self, driver: _driver.Driver, graph: int, executable: int, nodes: list[_Node]):
        self._driver = driver
        self._graph = graph  # kept: node handles belong to it
        self._executable = executable
        self._clear = nodes[0]
        self._check = nodes[1] if len(nodes) > 1 else None
        self._launch = driver.launch_graph
        # Counts compiled as i32: beyond this a call goes back to the JIT (triton_exec).
        self.max_count = min((_I32_LIMIT - 1) // node.tiles for node in nodes)

    def launch(self, count: int, check_at: int, check_count: int, stream: int) -> int:
        """Update the nodes whose counts changed, then enqueue the graph; returns the CUDA result
        code of the launch (updates raise on failure)."""
        clear = self._clear
        if count != clear.count:
            clear.set(self._executable, self._driver, clear.blocks, count)
        check = self._check
        if check is not None and (check_count != check.count or check_at != check.blocks):
            check.set(self._executable, self._driver, check_at, check_count)
        return self._launch(self._executable, stream)


def enqueue(  # noqa: PLR0917 (one call's facts, as the executor has them)
    launch: Launcher,
    staging: Staging,
    count: int,
    check_offset: int,
    check_count: int,
    stream: int,
    *,
    timed: bool,
) -> bool:
    """Enqueue one call through the staging's graph for its shape (built on first use): clear the
    `count` ids at the staging's start, read back `check_count` ids from word `check_offset`,
    record the three timing events when `timed`, and last the call's completion,
    `staging.completion(last_event(timed, check_count > 0))` (module docstring). False (nothing
    enqueued) when a graph cannot serve."""
    if not launch.graphs_enabled or staging.cuda is None or not staging.event_handles:
        return False
    check_at = staging.ids_address + 8 * check_offset
    key = (check_count > 0, timed)
    graph = staging.graphs.get(key, _NOT_BUILT)
    if graph is _NOT_BUILT:
        kernels = launch.graph_kernels(with_check=check_count > 0)
        if kernels is None:  # not compiled yet (the cache's first call), or graphs are off
            return False
        graph = staging.graphs[key] = _build(launch, staging, kernels, count, check_at, check_count,
                                             timed)  # fmt: skip
    if graph is None or count > graph.max_count or check_count > graph.max_count:
        return False  # refused once for this staging (logged), or counts beyond 32 bits
    if not launch.on_its_device():
        return False
    code = graph.launch(count, check_at, check_count, stream)
    if code:
        if _driver.needs_context(code):  # a thread that never used CUDA before
            staging.bind_context()
            code = graph.launch(count, check_at, check_count, stream)
        _driver.check(code, "cuGraphLaunch")
    return True


_NOT_BUILT = object()


def _build(  # noqa: PLR0917
    launch: Launcher,
    staging: Staging,
    kernels: tuple[Compiled, ...],
    count: int,
    check_at: int,
    check_count: int,
    timed: bool,
) -> CallGraph | None:
    addresses = (staging.ids_address, check_at, staging.flags_address)
    if min(addresses) < _I32_LIMIT:  # the kernels were compiled for 64-bit addresses
        return None
    segments, num_segments = launch.segments, launch.num_segments
    jobs: list[tuple[tuple[int, ...], Compiled]] = [
        ((segments, staging.ids_address, num_segments, count), kernels[0])
    ]
    if check_count:
        jobs.append(((segments, check_at, staging.flags_address, num_segments, check_count),
                     kernels[1]))  # fmt: skip
    nodes: list[_Node] = []
    for values, ready in jobs:
        work = num_segments * values[-1] * ready.tiles_per_chunk
        if ready.direct is None or work >= _I32_LIMIT:
            return None
        nodes.append(_Node(ready.direct, ready, (*values, work), min(work, ready.max_programs)))
    return _capture(launch, staging, nodes, timed)


def _capture(
    launch: Launcher, staging: Staging, nodes: list[_Node], timed: bool
) -> CallGraph | None:
    """Record the call's work on the launcher's private capture stream and instantiate it; None
    (logged, no ids) when the driver refuses: the caller then launches one by one."""
    driver = staging.cuda
    assert driver is not None, "only a CUDA staging captures"
    try:
        stream = launch.capture_stream()
        code = driver.begin_capture(stream)
        if _driver.needs_context(code):
            staging.bind_context()
            code = driver.begin_capture(stream)
        _driver.check(code, "cuStreamBeginCapture")
        try:
            _record_call(driver, staging, nodes, stream, timed)
        finally:
            code, graph = driver.end_capture(stream)
        _driver.check(code, "cuStreamEndCapture")
        executable = driver.instantiate(graph)
        handles = driver.kernel_nodes(graph)
        for node in nodes:
            node.handle = handles[node.kernel.function]
    except (ZeroizeError, KeyError) as exc:
        _log.event(logging.WARNING, "zeroize.graph_unavailable", reason=str(exc)[:200])
        return None
    return CallGraph(driver, graph, executable, nodes)


def _record_call(
    driver: _driver.Driver, staging: Staging, nodes: list[_Node], stream: int, timed: bool
) -> None:
    """The call's work, in order, on the capturing stream (nothing runs: it becomes the graph),
    ending with the record of its completion event (`last_event`)."""
    events = staging.event_handles
    if timed:
        driver.record_node(events[0], stream)
    if not staging.on_host:  # the whole buffer: the node never needs an update
        code = driver.copy_to_device(
            staging.ids_address, staging.host_ids_address, 8 * staging.capacity, stream
        )
        _driver.check_copy(code)
    for index, node in enumerate(nodes):
        if timed and index:
            driver.record_node(events[1], stream)
        _driver.check_launch(node.kernel.launch(node.args, node.params.grid_x, stream))
    last = last_event(timed, len(nodes) > 1)  # 1 after a lone clear, 2 after a check, else done
    driver.record_node(staging.done_handle if last == DONE else events[last], stream)
