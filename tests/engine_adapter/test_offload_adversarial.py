"""Found by an adversarial review of the offload tier (issue 15): each test states a guarantee of
docs/offload.md that did not hold before the fix (the comments say what happened then).

1. Group / public domains hold blocks of several tenants, but the scheduler keeps one representative
   scope per domain (the first spiller's): a tenant purge, a disable, and the tenant's own retention
   and offload.ttl_s miss the other tenants' entries.
2. An unreadable tier file (EIO, replaced inode) makes `load` raise instead of reporting a load error
   (vLLM's engine step dies rather than recomputing).
3. The start-up sweep follows symlinks: it deletes files outside the offload directory.
4. A spill whose file write fails leaves a partial ciphertext that no shred deletes.
"""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")

from kvguard.engine_adapter.records import PurgeKind, PurgeSelector
from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, TierOrder, TierReport
from kvguard.engine_adapter.vllm.worker_side import WorkerGuard
from kvguard.isolation.keyring import Keyring
from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeys
from kvguard.offload.index import TierKey
from kvguard.offload.tierdir import TierDirectory
from kvguard.policy import PolicySet
from tests.engine_adapter.conftest import scope_for
from tests.engine_adapter.test_tier_scheduler import BS, FakeRequest, Harness

_GROUPS = {
    "share_groups": {
        "g1": {"prefixes": [{"id": "p", "digest": "sha256:" + "0" * 64, "tokens": 64}]}
    }
}


def _group_harness(b_policy: dict) -> tuple[Harness, FakeRequest]:
    policy = PolicySet.model_validate(
        {
            **_GROUPS,
            "tenants": {
                "a": {
                    "reuse": "group",
                    "groups": ["g1"],
                    "offload": {"allowed": True, "ttl_s": 1e4},
                },
                "b": {"reuse": "group", "groups": ["g1"], **b_policy},
            },
        }
    )
    h = Harness(policy, restore_us_per_block=1, prefill_us_per_token=100)

    def finish(rid: str, tenant: str, blocks: list[int], names: list[bytes]) -> FakeRequest:
        for b, n in zip(blocks, names, strict=True):
            h.pool.blocks[b].block_hash = n + b"\0\0\0\0"
            h.cached.add(b)
        req = FakeRequest(rid, names, len(names) * BS + 1)
        h.tier.note_cached(
            req, scope_for(tenant, group="g1"), blocks, h.pool, life=lambda _b: (h.now, h.now)
        )
        return req

    finish("ra", "a", [1], [b"a-h0"])  # tenant a spills into the group domain first
    h.evict([1])
    h.worker_does()
    req = finish("rb", "b", [2, 3], [b"b-h0", b"b-h1"])  # then tenant b's own blocks
    h.evict([2, 3])
    h.worker_does()
    return h, req


OFFLOAD_B = {"offload": {"allowed": True, "ttl_s": 1e4}}


def test_a_tenant_purge_shreds_the_group_domain_holding_its_offloaded_blocks() -> None:
    h, _ = _group_harness(OFFLOAD_B)
    figures = h.tier.purge(PurgeSelector(PurgeKind.TENANT, "b"), 7)
    shred = h.tier.take_orders()[2]
    assert figures["tier_key_count"] == 1 and len(shred) == 1  # was: 0 keys, no shred order


def test_disabling_a_tenant_shreds_the_group_domain_holding_its_offloaded_blocks() -> None:
    h, _ = _group_harness(OFFLOAD_B)
    h.policy = PolicySet.model_validate(
        {
            **_GROUPS,
            "tenants": {
                "a": {"reuse": "group", "groups": ["g1"], "offload": {"allowed": True}},
                "b": {"enabled": False},
            },
        }
    )
    h.tier.on_policy()
    assert len(h.tier.take_orders()[2]) == 1


def test_offloaded_group_blocks_are_charged_to_and_expire_by_their_own_tenant() -> None:
    h, req = _group_harness(
        {"retention": {"ttl_s": 10, "idle_s": 10}, "offload": {"allowed": True, "ttl_s": 5}}
    )
    assert h.tier.index.tenant_bytes("b") == 2000  # was: 0, all charged to tenant a
    h.now += 60  # past b's retention and its offload.ttl_s
    h.tier.sweep(h.now)
    again = FakeRequest("rb2", req.block_hashes, req.num_tokens)
    assert h.tier.match(again, scope_for("b", group="g1"), 0, None) == 0  # was: 32 restored


def test_an_unreadable_tier_file_is_a_load_error_not_an_exception(tmp_path: Path) -> None:
    worker = WorkerGuard(offload=(Keyring.generate(), 1 << 20, str(tmp_path)))
    layers = [
        torch.randint(1, 100, (16, 2, 4, 16), dtype=torch.int16).to(torch.bfloat16)
        for _ in range(2)
    ]
    worker.register({"layer.0": layers[0], "layer.1": layers[1]})
    key = TierKey(b"dom", b"h0", 0)
    worker.on_step(GuardStepMeta(step=1, spill=(TierOrder(3, key, "st_a", True),)))
    worker.take_results()
    (entry,) = worker.tier.tier._entries.values()
    os.unlink(entry.path)
    os.mkdir(entry.path)  # reading it raises an OSError, as an I/O error would
    worker.load((TierOrder(9, key, "st_a"),))  # was: IsADirectoryError escaped
    assert worker.load_errors() == {9}


def test_the_start_up_sweep_never_follows_a_symlink_out_of_the_directory(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("not the tier's")
    root = tmp_path / "offload"
    root.mkdir()
    os.symlink(victim, root / "tier-1-dead")  # no lock file: "an interrupted sweep"
    TierDirectory(root)
    assert (victim / "keep.txt").exists()  # was: deleted


def test_a_failed_spill_write_leaves_no_ciphertext_behind(tmp_path: Path) -> None:
    tier = EncryptedTier(
        OffloadKeys(Keyring.generate()), budget_bytes=1 << 22, directory=tmp_path, clock=lambda: 0.0
    )
    address = BlockAddress(b"A", "st", b"h", (0, 2), 0)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))  # a full disk, in effect
    try:
        with pytest.raises(OSError):
            tier.put(address, os.urandom(1 << 20), to_disk=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, old)
    tier.shred(b"A")
    assert tier._dir is not None and list(tier._dir.iterdir()) == []  # was: a 100 kB partial file
    tier.close()


def test_a_spill_the_worker_failed_is_forgotten_at_the_next_report() -> None:
    """The scheduler notes each ordered spill's tenant until the worker reports it; a spill that
    fails in the worker (disk full) is reported as failed and must not stay noted for ever. A
    report that does not answer a spill leaves it noted: under vLLM's async scheduling the next
    step's spills are ordered before the previous step's report arrives."""
    h, _ = _group_harness(OFFLOAD_B)
    req = FakeRequest("rc", [b"c-h0"], BS + 1)
    h.pool.blocks[4].block_hash = b"c-h0" + b"\0\0\0\0"
    h.cached.add(4)
    h.tier.note_cached(req, scope_for("b", group="g1"), [4], h.pool, life=lambda _b: (h.now, h.now))
    h.evict([4])
    spills = h.tier.take_orders()[0]
    assert spills  # ordered
    h.tier.on_report(TierReport())  # a report of an earlier step: the spill is still on its way
    assert list(h.tier._spilling) == [o.key for o in spills]
    h.tier.on_report(TierReport(spill_failed=list(spills)))  # the worker failed it
    assert h.tier._spilling == {}
    assert h.tier.index.tenant_bytes("b") == 2000  # the earlier, reported spills stay indexed
