"""The host-side pieces of the fast enqueue path (issue 14, item 2), on any machine: the checks that
decide whether a Triton kernel may be described to the driver (and so become a graph node), the
argument arrays handed to it, the id packing and mode parsing. Graphs themselves run in test_gpu."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvguard.errors import ZeroizeError
from kvguard.zeroize import KVLayout, VerifyMode, _driver, callgraph, direct, plan_zeroize, zeroize
from kvguard.zeroize.staging import Staging, StagingPool
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

    def set_kernel_params(self, executable: int, node: int, params: Any) -> int:
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
