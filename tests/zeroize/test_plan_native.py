"""The C planner (`kvguard.zeroize._plan`) against the pure-Python one: same ids, same runs, same errors.

`plan.py` hands a list of plain ints to C and everything else (booleans, numpy integers, ids beyond
64 bits, non-integers) to Python, so the comparisons below draw inputs from both sides of that line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvguard.errors import BlockIdError
from kvguard.zeroize import plan as planner

needs_native = pytest.mark.skipif(
    not planner.native_planner_available(), reason="the C planner is not built"
)

# Ids around every boundary the C path has: 0, small caches, int64's ends and one past them.
EDGE_IDS = [0, 1, 63, 64, 65, 2**62, 2**63 - 2, 2**63 - 1, 2**63, 2**64, -1, -(2**63), -(2**63) - 1]
plain_ids = st.one_of(
    st.integers(min_value=-3, max_value=300),  # many duplicates and neighbours
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EDGE_IDS),
)
other_ids = st.one_of(
    st.booleans(),
    st.builds(np.int64, st.integers(min_value=-3, max_value=300)),
    st.builds(np.uint8, st.integers(min_value=0, max_value=255)),
    st.builds(np.int32, st.integers(min_value=-3, max_value=300)),
    st.sampled_from([1.0, "3", None, (1,), b"\x01"]),
)
cache_sizes = st.one_of(
    st.integers(min_value=1, max_value=400),
    st.integers(min_value=1, max_value=2**70),
    st.sampled_from([2**63 - 1, 2**63, 2**63 + 1, 2**64, 5_000_000]),
)


@st.composite
def cache_and_ids(draw: st.DrawFn, extra: st.SearchStrategy[object]) -> tuple[int, list[object]]:
    """A cache size and ids mostly inside it (the C path's success case), some from `extra`."""
    size = draw(cache_sizes)
    inside = st.integers(min_value=0, max_value=size - 1)
    mixed = st.one_of(inside, inside, inside, extra)
    items = draw(st.lists(inside if draw(st.booleans()) else mixed, max_size=80))
    return size, items


# Each container is built fresh for every call: a generator can only be read once.
Container = Callable[[list[object]], Iterable[object]]
CONTAINERS: list[Container] = [list, tuple, lambda xs: (x for x in xs), iter, lambda xs: xs.copy()]
containers = st.sampled_from(CONTAINERS)


def outcome(
    canonical: Callable[[Iterable[int], int], tuple[int, ...]], ids: Iterable[object], size: int
) -> tuple[str, object]:
    try:
        found = canonical(ids, size)  # type: ignore[arg-type]
    except BlockIdError as exc:
        return ("refused", str(exc))
    assert all(type(block_id) is int for block_id in found)
    return ("planned", found)


def assert_same(items: list[object], size: int, make: Container) -> None:
    native = outcome(planner._canonical_ids, make(items), size)
    python = outcome(planner._canonical_ids_python, make(items), size)
    assert native == python


def test_the_native_planner_is_built() -> None:
    """CI must not fall back to the slow path silently; a machine without a compiler opts out."""
    if os.environ.get("KVGUARD_ALLOW_PURE_PLANNER") == "1":
        pytest.skip("KVGUARD_ALLOW_PURE_PLANNER=1: the pure-Python planner is allowed here")
    assert planner.native_planner_available(), (
        "kvguard.zeroize._plan is not built: run `pip install -e .` with a C compiler, "
        "or set KVGUARD_ALLOW_PURE_PLANNER=1 to accept the pure-Python planner"
    )


@needs_native
@settings(max_examples=400)
@given(cache_and_ids(plain_ids), containers)
def test_plain_int_ids_plan_the_same_in_c_and_python(
    case: tuple[int, list[object]], make: Container
) -> None:
    size, items = case
    assert_same(items, size, make)


@needs_native
@settings(max_examples=400)
@given(cache_and_ids(st.one_of(plain_ids, other_ids)), containers)
def test_mixed_ids_plan_the_same_in_c_and_python(
    case: tuple[int, list[object]], make: Container
) -> None:
    size, items = case
    assert_same(items, size, make)


@needs_native
@given(st.lists(st.integers(min_value=0, max_value=5_000), min_size=1, max_size=3_000))
def test_dense_and_sparse_bitmaps_plan_the_same(items: list[int]) -> None:
    # Spans from one word to ~80 words per id: both the bitmap and the sort branch of _plan.c.
    assert_same(list(items), 5_001, list)
    assert_same([i * 4_099 for i in items], 2**40, list)


@needs_native
@settings(max_examples=300)
@given(st.lists(plain_ids, max_size=60))
@example([2**63 - 1, -(2**63), -(2**63) + 1])  # int64's last id followed by its first: no run
def test_runs_are_the_same_in_c_and_python(items: list[int]) -> None:
    # Any tuple of ints, not only a canonical one (ZeroizePlan can be built directly), including
    # ids beyond int64, which C hands back to Python.
    ids = tuple(items)
    assert planner._coalesce(ids) == planner._coalesce_python(ids)
    canonical = tuple(sorted(set(items)))
    runs = planner._coalesce(canonical)
    assert runs == planner._coalesce_python(canonical)
    assert all(type(start) is int and type(length) is int for start, length in runs)


@pytest.mark.parametrize(
    ("items", "size", "bad"),
    [
        ([5, -2, 9, -7, 3], 8, -7),  # the smallest negative id, even when a larger one is too large
        ([0, 9, 8, 3], 8, 9),  # the largest too-large id
        ([2**63 - 1], 2**63 - 1, 2**63 - 1),
        ([-(2**63)], 4, -(2**63)),
    ],
)
def test_out_of_range_errors_name_the_same_id(items: list[int], size: int, bad: int) -> None:
    for canonical in (planner._canonical_ids, planner._canonical_ids_python):
        with pytest.raises(BlockIdError, match=rf"^block id {bad} is outside .*\[0, {size}\)$"):
            canonical(items, size)


def test_a_cache_size_of_an_int_subclass_plans_the_same() -> None:
    class Blocks(int):
        def __repr__(self) -> str:
            return "Blocks()"

    for make in CONTAINERS:
        assert_same([3, 1, 3], Blocks(8), make)
        assert_same([3, 9], Blocks(8), make)
    assert planner.plan_zeroize([2, 1], Blocks(8)).block_ids == (1, 2)


@needs_native
def test_the_extension_declines_what_python_owns() -> None:
    native = pytest.importorskip("kvguard.zeroize._plan")
    for declined in ([1, True], [np.int64(3)], [2**63], [1.0], [None]):
        assert native.unique_sorted(declined, 8) is None
    assert native.unique_sorted((3, 1, 3), 8) == (1, 3)
    with pytest.raises(IndexError) as caught:
        native.unique_sorted([1, 8], 8)
    assert caught.value.args == (8,)
    with pytest.raises(TypeError):
        native.unique_sorted(iter([1]), 8)
    assert native.coalesce((1, 2, 2**63 - 1)) == ((1, 2), (2**63 - 1, 1))
    assert native.coalesce((1, np.int64(2))) is None


def test_without_the_extension_the_python_planner_answers() -> None:
    code = (
        "import sys\n"
        "sys.modules['kvguard.zeroize._plan'] = None\n"  # as if built without a compiler
        "from kvguard.zeroize import plan, plan_zeroize\n"
        "assert not plan.native_planner_available()\n"
        "p = plan_zeroize(iter([9, 3, 4, 5, 4, 10, 0, 3]), 12)\n"
        "assert p.block_ids == (0, 3, 4, 5, 9, 10), p\n"
        "assert p.runs == ((0, 1), (3, 3), (9, 2)), p.runs\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
