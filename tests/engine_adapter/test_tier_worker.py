"""The worker half of the offload tier (issue 15) on a CPU KV cache, no engine: spill before the
step's clears, restore after them, authentication failures reported as load errors, shreds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")

from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, ShredOrder, TierOrder
from kvguard.engine_adapter.vllm.worker_side import WorkerGuard
from kvguard.isolation.keyring import Keyring
from kvguard.offload.index import TierKey

NUM_BLOCKS = 16
DOMAIN = b"domain-a"


def _worker() -> tuple[WorkerGuard, list[torch.Tensor]]:
    worker = WorkerGuard(offload=(Keyring.generate(), 1 << 20, None))
    layers = [
        torch.randint(1, 100, (NUM_BLOCKS, 2, 4, 16), dtype=torch.int16).to(torch.bfloat16)
        for _ in range(2)
    ]
    worker.register({"layer.0": layers[0], "layer.1": layers[1]})
    return worker, layers


def order(block: int, position: int, domain: bytes = DOMAIN) -> TierOrder:
    return TierOrder(block, TierKey(domain, f"h{position}".encode(), position), "st_a")


def test_a_spilled_block_is_restored_bit_exact_after_its_handover_clear() -> None:
    worker, layers = _worker()
    before = [layer[3].clone() for layer in layers]
    # Step 1: block 3 is evicted and handed to another scope: spilled, then cleared.
    worker.on_step(GuardStepMeta(step=1, handover=(3,), verify="full", spill=(order(3, 0),)))
    assert all(not layer[3].any() for layer in layers)
    report = worker.take_results().tier
    assert report is not None and [o.block_id for o, _ in report.spilled] == [3]
    assert report.spilled[0][1] == worker.tier.copier.block_bytes + 16
    assert report.restore_s_per_block is not None and report.block_bytes is not None
    # Step 2: the owner's repeat restores it into block 9 (cleared first, then loaded).
    worker.on_step(GuardStepMeta(step=2, handover=(9,), verify="full"))
    worker.load((TierOrder(9, order(3, 0).key, "st_a"),))
    assert all(torch.equal(layer[9], old) for layer, old in zip(layers, before, strict=True))
    assert worker.load_errors() == set()
    assert [o.block_id for o in worker.take_results().tier.restored] == [9]


def test_a_tampered_entry_is_a_load_error_and_is_never_copied_in() -> None:
    worker, layers = _worker()
    worker.on_step(GuardStepMeta(step=1, spill=(order(3, 0), order(4, 1))))
    worker.take_results()
    (entry, _) = list(worker.tier.tier._entries.values())
    data = bytearray(entry.data)
    data[7] ^= 0x80
    entry.data = bytes(data)
    for layer in layers:
        layer[10:12].zero_()
    worker.load((TierOrder(10, order(3, 0).key, "st_a"), TierOrder(11, order(4, 1).key, "st_a")))
    assert worker.load_errors() == {10}  # vLLM recomputes block 10
    assert all(not layer[10].any() for layer in layers)  # nothing of the damaged entry was used
    assert all(layer[11].any() for layer in layers)
    report = worker.take_results().tier
    assert [(o.block_id, reason) for o, reason in report.failed] == [(10, "auth")]
    assert worker.load_errors() == set()  # reported once


def test_a_lookup_from_another_domain_misses() -> None:
    worker, _ = _worker()
    worker.on_step(GuardStepMeta(step=1, spill=(order(3, 0),)))
    worker.load((TierOrder(5, order(3, 0, domain=b"domain-b").key, "st_b"),))
    assert worker.load_errors() == {5}


def test_a_shred_after_a_spill_in_the_same_step_deletes_it() -> None:
    worker, _ = _worker()
    shred = ShredOrder(DOMAIN, "st_a", "purge", 9)
    worker.on_step(GuardStepMeta(step=1, spill=(order(3, 0),), shred=(shred,)))
    report = worker.take_results().tier
    (done,) = report.shredded
    assert (done.destroyed_epoch, done.entries, done.order.command_id) == (0, 1, 9)
    assert len(worker.tier.tier) == 0
    worker.load((TierOrder(5, order(3, 0).key, "st_a"),))
    assert worker.load_errors() == {5}


def test_drop_orders_delete_entries() -> None:
    worker, _ = _worker()
    worker.on_step(GuardStepMeta(step=1, spill=(order(3, 0), order(4, 1))))
    worker.on_step(GuardStepMeta(step=2, drop=(TierOrder(-1, order(3, 0).key, "st_a"),)))
    assert len(worker.tier.tier) == 1


def test_disk_entries_are_private_files_without_plaintext(tmp_path) -> None:
    worker = WorkerGuard(offload=(Keyring.generate(), 1 << 20, str(tmp_path / "tier")))
    layer = torch.randint(1, 100, (NUM_BLOCKS, 2, 4, 16), dtype=torch.int16).to(torch.bfloat16)
    worker.register({"layer.0": layer})
    plain = bytes(worker.tier.copier.read([3])[0])
    disk = TierOrder(3, order(3, 0).key, "st_a", to_disk=True)
    worker.on_step(GuardStepMeta(step=1, spill=(disk,)))
    (path,) = list(
        (tmp_path / "tier").glob("kvguard-tier/*/*.kvb")
    )  # in this process's own subdirectory
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "tier").stat().st_mode & 0o777 == 0o700
    assert plain[:64] not in path.read_bytes()
    layer[9].zero_()
    worker.load((TierOrder(9, disk.key, "st_a"),))
    assert worker.load_errors() == set() and torch.equal(layer[9], layer[3])
