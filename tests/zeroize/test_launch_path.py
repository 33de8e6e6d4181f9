"""The host-side pieces of the fast enqueue path (issue 14, item 2), on any machine: the checks that
decide whether a Triton kernel may be described to the driver (and so become a graph node), the
argument arrays handed to it, the id packing and mode parsing. Graphs themselves run in test_gpu."""

from __future__ import annotations

import ctypes
import functools
import itertools
import struct
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvguard.errors import ZeroizeError
from kvguard.zeroize import KVLayout, VerifyMode, _driver, callgraph, direct, plan_zeroize, zeroize
from kvguard.zeroize import staging as staging_mod
from kvguard.zeroize.staging import DONE, Staging, StagingPool, last_event
from kvguard.zeroize.verify import parse_mode
from tests.zeroize.factories import make_cache

CLEAR_SIZES = (8, 8, 4, 4, 4)


def plain_meta(**changes: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {
        "num_warps": 8, "shared": 128, "num_ctas": 1, "launch_cooperative_grid": False,
        "launch_pdl": False, "global_scratch_size": 0, "profile_scratch_size": 0,
    }  # fmt: skip
    fields.update(changes)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("hidden", [(), (8,), (8, 8)])
def test_parameter_layout_accepts_the_kernel_with_its_scratch_pointers(
    hidden: tuple[int, ...],
) -> None:
    assert direct.parameter_layout((*CLEAR_SIZES, *hidden), CLEAR_SIZES) == (*CLEAR_SIZES, *hidden)


@pytest.mark.parametrize(
    "actual",
    [
        None,  # the driver could not say
        (8, 8, 4, 4),  # a parameter missing
        (8, 8, 8, 4, 4),  # a count compiled as 64-bit: its cell would be the wrong width
        (8, 4, 4, 4, 4),  # an address compiled as 32-bit
        (*CLEAR_SIZES, 8, 8, 8),  # more trailing parameters than Triton's two scratch pointers
        (*CLEAR_SIZES, 4),  # a trailing parameter that is not a pointer
    ],
)
def test_parameter_layout_refuses_anything_else(actual: tuple[int, ...] | None) -> None:
    assert direct.parameter_layout(actual, CLEAR_SIZES) is None


def test_only_a_plain_launch_configuration_is_launched_directly() -> None:
    assert direct.launch_config_is_plain(plain_meta())
    assert direct.launch_config_is_plain(SimpleNamespace(num_warps=4, shared=0))  # older Triton
    for change in (
        {"num_ctas": 2},
        {"launch_cooperative_grid": True},
        {"launch_pdl": True},
        {"global_scratch_size": 64},
        {"profile_scratch_size": 64},
        {"shared": 300 * 1024},
        {"num_warps": None},
    ):
        assert not direct.launch_config_is_plain(plain_meta(**change)), change


class FakeDriver:
    """Records launches and reads the argument values back through the pointer array."""

    def __init__(self, sizes: tuple[int, ...] | None) -> None:
        self.sizes = sizes
        self.launches: list[tuple[int, int, int, int, int, list[int]]] = []

    def parameter_sizes(self, function: int) -> tuple[int, ...] | None:
        return self.sizes

    def launch(
        self, function: int, grid: int, block: int, shared: int, stream: int, params: int
    ) -> int:
        assert self.sizes is not None
        pointers = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        values = [
            (ctypes.c_int64 if size == 8 else ctypes.c_int32).from_address(pointer).value
            for size, pointer in zip(self.sizes, pointers, strict=True)
        ]
        self.launches.append((function, grid, block, shared, stream, values))
        return 0


def compiled(meta: SimpleNamespace, function: int = 0xBEEF) -> SimpleNamespace:
    return SimpleNamespace(function=function, metadata=meta)


def test_a_direct_launch_passes_the_values_block_and_shared_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeDriver((*CLEAR_SIZES, 8, 8))
    monkeypatch.setattr(_driver, "driver", lambda: fake)
    kernel = direct.prepare(compiled(plain_meta(num_warps=8, shared=512)), CLEAR_SIZES)
    assert kernel is not None
    args = kernel.args((1 << 40, 1 << 41, 64, 3, 384))
    assert kernel.launch(args, grid=384, stream=77) == 0
    args.update((1 << 40, 1 << 41, 64, 1, 128))  # the next call on the same site
    kernel.launch(args, grid=128, stream=77)
    assert fake.launches == [
        (0xBEEF, 384, 256, 512, 77, [1 << 40, 1 << 41, 64, 3, 384, 0, 0]),
        (0xBEEF, 128, 256, 512, 77, [1 << 40, 1 << 41, 64, 1, 128, 0, 0]),
    ]


def test_no_direct_launch_without_a_driver_or_with_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_driver, "driver", lambda: None)
    assert direct.prepare(compiled(plain_meta()), CLEAR_SIZES) is None
    monkeypatch.setattr(_driver, "driver", lambda: FakeDriver((8, 8, 8, 4, 4)))
    assert direct.prepare(compiled(plain_meta()), CLEAR_SIZES) is None
    monkeypatch.setattr(_driver, "driver", lambda: FakeDriver((*CLEAR_SIZES, 8)))
    assert direct.prepare(compiled(plain_meta(launch_pdl=True)), CLEAR_SIZES) is None
    assert direct.prepare(compiled(plain_meta(), function=0), CLEAR_SIZES) is None


def test_staging_packs_ids_and_checked_ids_as_int64() -> None:
    staging = StagingPool(torch.device("cpu")).take(5)
    assert not staging.on_host and staging.capacity == 64
    staging.write_ids((3, 1 << 40, 0))
    staging.write_ids([7, 9], 3)
    assert staging.host_ids[:5].tolist() == [3, 1 << 40, 0, 7, 9]
    assert staging.ids_address == staging.host_ids.data_ptr()  # off the GPU: the host buffer


def test_cpu_stagings_never_read_ids_in_place() -> None:
    assert not Staging(torch.device("cpu"), 64, host_ids_max=1 << 20).on_host


def test_mode_strings_parse_and_bad_ones_are_refused() -> None:
    assert [parse_mode(m) for m in ("none", "sample", "full")] == list(VerifyMode)
    assert parse_mode(VerifyMode.FULL) is VerifyMode.FULL
    for bad in ("FULL", "", None, 3):
        with pytest.raises(ZeroizeError):
            parse_mode(bad)  # type: ignore[arg-type]


def test_untimed_evidence_says_timings_are_absent() -> None:
    spec = make_cache(KVLayout.VLLM_FLASH, torch.bfloat16, num_blocks=6)
    evidence = zeroize(spec, plan_zeroize([1, 2], 6), verify="full", method="torch", timed=False)
    assert evidence.verified and evidence.blocks_verified == 2
    assert evidence.device_time_us is None and evidence.verify_time_us is None


class FakeGraphDriver:
    """Records node updates and graph launches, reading the argument values back."""

    def __init__(self) -> None:
        self.updates: list[tuple[int, int, list[int]]] = []
        self.launches = 0

    def set_kernel_params(self, executable: int, node: int, address: int) -> int:
        params = _driver.KernelNodeParams.from_address(address)
        pointers = (ctypes.c_void_p * 5).from_address(params.params)
        sizes = (8, 8, 4, 4, 4)
        values = [
            (ctypes.c_int64 if size == 8 else ctypes.c_int32).from_address(pointer).value
            for size, pointer in zip(sizes, pointers, strict=True)
        ]
        self.updates.append((node, params.grid_x, values))
        return 0

    def launch_graph(self, executable: int, stream: int) -> int:
        self.launches += 1
        return 0


def test_a_call_graph_updates_its_nodes_only_when_the_counts_change() -> None:
    fake = FakeGraphDriver()
    kernel = direct.DirectKernel(SimpleNamespace(function=7), fake, CLEAR_SIZES, 256, 0)  # type: ignore[arg-type]
    ready = SimpleNamespace(tiles_per_chunk=2, max_programs=528)
    node = callgraph._Node(kernel, ready, (1 << 40, 1 << 41, 64, 3, 384), 384)  # type: ignore[arg-type]
    node.handle = 11
    graph = callgraph.CallGraph(fake, 1, 2, [node])  # type: ignore[arg-type]
    assert graph.launch(3, 0, 0, stream=0) == 0 and fake.updates == []  # as captured
    graph.launch(10, 0, 0, stream=0)  # 64 segments x 10 blocks x 2 tiles: 1280 items, grid capped
    graph.launch(10, 0, 0, stream=0)
    graph.launch(1, 0, 0, stream=0)
    assert fake.updates == [
        (11, 528, [1 << 40, 1 << 41, 64, 10, 1280]),
        (11, 128, [1 << 40, 1 << 41, 64, 1, 128]),
    ]
    assert fake.launches == 4
    assert graph.max_count == ((1 << 31) - 1) // 128


def test_no_graph_off_the_gpu() -> None:
    staging = StagingPool(torch.device("cpu")).take(2)
    launch = SimpleNamespace(graphs_enabled=True)
    assert not callgraph.enqueue(launch, staging, 2, 0, 2, 0, timed=True)  # type: ignore[arg-type]
    assert staging.graphs == {}


# --- the per-call passes in C (issue 14, item 2, third pass) ----------------------------------------

needs_native = pytest.mark.skipif(staging_mod._pack is None, reason="the C extension is not built")


@needs_native
@pytest.mark.parametrize(
    "ids", [(), (0,), (3, 1 << 40, 0), [7, 9], tuple(range(64)), [2**63 - 1, -(2**63)]]
)
def test_c_packing_writes_what_struct_writes(ids: tuple[int, ...] | list[int]) -> None:
    from kvguard.zeroize import _plan  # noqa: PLC0415  (built: needs_native)

    ours, theirs = bytearray(8 * 70), bytearray(8 * 70)
    assert _plan.pack(memoryview(ours), ids, 3)
    struct.pack_into(f"{len(ids)}q", theirs, 24, *ids)
    assert ours == theirs


@needs_native
def test_c_packing_declines_what_is_not_a_plain_int64_and_refuses_overflow() -> None:
    from kvguard.zeroize import _plan  # noqa: PLC0415

    buffer = memoryview(bytearray(8 * 4))
    for bad in ([1, True], [np.int64(3)], [1 << 63], [-(2**63) - 1], [1.0]):
        assert _plan.pack(buffer, bad, 0) is False
    with pytest.raises(ValueError, match="do not fit"):
        _plan.pack(buffer, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="do not fit"):
        _plan.pack(buffer, [1], -1)
    staging = StagingPool(torch.device("cpu")).take(3)
    staging.write_ids([np.int64(5), 6, True])  # type: ignore[list-item]  # struct's path then
    assert staging.host_ids[:3].tolist() == [5, 6, 1]


@needs_native
def test_hot_driver_calls_go_through_the_trampoline_with_ctypes_results() -> None:
    libc = ctypes.CDLL(None)
    strcmp = libc.strcmp
    strcmp.argtypes, strcmp.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    hot = _driver._hot(strcmp)
    assert isinstance(hot, functools.partial)  # not the ctypes function itself
    a, b = ctypes.create_string_buffer(b"abc"), ctypes.create_string_buffer(b"abd")
    for x, y in ((a, b), (b, a), (a, a)):
        pair = (ctypes.addressof(x), ctypes.addressof(y))
        assert (hot(*pair) > 0) == (strcmp(*pair) > 0) and (hot(*pair) == 0) == (x is y)


class Recorder:
    """A staging and its graphs that log what is enqueued, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        self.cuda = object()
        self.event_handles = (1, 2, 3)
        self.done_handle = 4
        self.ids_address = 1 << 40
        self.graphs: dict[tuple[bool, bool], Any] = {}

    def record(self, index: int, stream: object, handle: int) -> None:
        self.log.append(("record", index))

    def graph(self, key: tuple[bool, bool]) -> Any:
        def launch(count: int, check_at: int, check_count: int, stream: int) -> int:
            self.log.append(("graph", key))
            return 0

        return SimpleNamespace(max_count=1 << 20, launch=launch)


@pytest.mark.parametrize(("check_count", "timed"), [(0, False), (8, False), (0, True), (8, True)])
def test_a_graph_call_is_one_driver_call(check_count: int, timed: bool) -> None:
    """The graph of the call's shape holds its completion record: nothing else is enqueued."""
    staging = Recorder()
    for key in itertools.product((False, True), repeat=2):
        staging.graphs[key] = staging.graph(key)
    launch = SimpleNamespace(graphs_enabled=True, on_its_device=lambda: True)
    enqueued = callgraph.enqueue(launch, staging, 16, 16, check_count, 0, timed=timed)  # type: ignore[arg-type]
    assert enqueued and staging.log == [("graph", (check_count > 0, timed))]


class CaptureDriver:
    """Logs what a capture records: copy, kernel launches, event-record nodes."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def copy_to_device(self, device: int, host: int, size: int, stream: int) -> int:
        self.log.append(("copy", size))
        return 0

    def record_node(self, event: int, stream: int) -> None:
        self.log.append(("event", event))


def capture_node(driver: CaptureDriver, function: int) -> Any:
    def launch(args: object, grid: int, stream: int) -> int:
        driver.log.append(("kernel", function))
        return 0

    return SimpleNamespace(kernel=SimpleNamespace(launch=launch), args=None,
                           params=SimpleNamespace(grid_x=1))  # fmt: skip


@pytest.mark.parametrize(("nodes", "timed"), [(1, False), (2, False), (1, True), (2, True)])
def test_a_captured_call_is_one_chain_ending_in_its_completion(nodes: int, timed: bool) -> None:
    """The last node records the event the handle waits on (`last_event`), after all the work."""
    driver = CaptureDriver()
    handles = {0: 11, 1: 12, 2: 13, DONE: 14}
    staging = SimpleNamespace(on_host=False, ids_address=1, host_ids_address=2, capacity=64,
                              event_handles=(11, 12, 13), done_handle=14)  # fmt: skip
    kernels = [capture_node(driver, function) for function in (101, 102)[:nodes]]
    callgraph._record_call(driver, staging, kernels, 5, timed)  # type: ignore[arg-type]
    completion = ("event", handles[last_event(timed, nodes > 1)])
    if timed:
        middle = [("event", 12), ("kernel", 102)] if nodes > 1 else []
        assert driver.log == [("event", 11), ("copy", 512), ("kernel", 101), *middle, completion]
        assert completion == ("event", 13 if nodes > 1 else 12)
    else:
        kernels_run = [("kernel", f) for f in (101, 102)[:nodes]]
        assert driver.log == [("copy", 512), *kernels_run, completion]
        assert completion == ("event", 14)


def test_the_default_clock_stamps_the_evidence_in_utc() -> None:
    spec = make_cache(KVLayout.MLA, torch.bfloat16, num_blocks=4)
    before = datetime.now(UTC)
    evidence = zeroize(spec, plan_zeroize([1], 4), verify="full", method="torch")
    assert evidence.timestamp.tzinfo is UTC and before <= evidence.timestamp <= datetime.now(UTC)
    fixed = datetime(2026, 11, 27, 4, 0, tzinfo=UTC)
    stamped = zeroize(
        spec, plan_zeroize([1], 4), verify="none", method="torch", clock=lambda: fixed
    )
    assert stamped.timestamp == fixed  # an injected clock is used as it is
