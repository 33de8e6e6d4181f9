"""The offload tier's orders within one step, against the real worker tier (a review).

The worker carries out a step's orders in a fixed order (spill, drop, shred, then load), whatever
order the scheduler queued them in. Each test failed before its fix:

- a shred of a domain (expiry, a failed load's domain left empty) or a drop of a key queued before
  a spill into it: the worker stored the spill and deleted it at once, while the index kept the
  entry (charged to the budget, promised to `match`, and counted by a later purge whose
  `key.shred` then showed none of it);
- a drop queued after a spill of the same key in one step (the sweep runs after the schedule):
  the same phantom entry;
- `offload.disk` revoked in the step that ordered a disk spill: the file was written after the
  revocation and stayed;
- a spill that failed in the worker while its domain's last entry was dropped: the domain was
  left empty with a live data key (and a step whose spills all failed sent no report at all).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from kvguard.engine_adapter.records import EventKind, PurgeKind, PurgeSelector
from kvguard.engine_adapter.vllm.metadata import GuardStepMeta, TierReport
from kvguard.engine_adapter.vllm.worker_side import WorkerGuard
from kvguard.isolation.keyring import Keyring
from tests.engine_adapter.conftest import scope_for
from tests.engine_adapter.test_tier_scheduler import BS, FakeRequest, Harness, policies

NUM_BLOCKS = 16


def _worker(directory: Any = None) -> WorkerGuard:
    worker = WorkerGuard(offload=(Keyring.generate(), 1 << 20, directory))
    layers = [
        torch.randint(1, 100, (NUM_BLOCKS, 2, 4, 16), dtype=torch.int16).to(torch.bfloat16)
        for _ in range(2)
    ]
    worker.register({"layer.0": layers[0], "layer.1": layers[1]})
    worker.take_results()  # the start-up profile
    return worker


def _harness(ttl_s: int) -> Harness:
    """Tenant a may offload, its entries kept `ttl_s` in the tier; restoring always pays."""
    offload = {"offload": {"allowed": True, "ttl_s": ttl_s}}
    return Harness(policies(a=offload), restore_us_per_block=1, prefill_us_per_token=100)


def _one_of_two_spilled() -> tuple[Harness, WorkerGuard]:
    """Tenant a's request ends with blocks 1 and 2 cached (entries kept 100 s in the tier); vLLM
    evicts block 1 and it is spilled: one entry in the index and in the worker."""
    h = _harness(ttl_s=100)
    w = _worker()
    h.finish("r1", "a", [1, 2], 2)
    h.evict([1])
    run_step(h, w)
    return h, w


_step = [0]  # GuardStepMeta step numbers, unique across the tests


def run_step(h: Harness, worker: WorkerGuard) -> Any:
    """One engine step: the scheduler's orders to the real worker, the worker's report back."""
    spill, drop, shred, load = h.tier.take_orders()
    _step[0] += 1
    worker.on_step(GuardStepMeta(step=_step[0], spill=spill, drop=drop, shred=shred, load=load))
    worker.load(load)
    errors = worker.load_errors()
    out = worker.take_results()
    if out is not None and out.tier is not None:
        h.tier.on_report(out.tier)
    return errors


def worker_entries(worker: WorkerGuard) -> int:
    return len(worker.tier.tier)


def test_expiry_shred_then_spill_same_domain_same_batch_leaves_phantom_index_entry() -> None:
    h, w = _one_of_two_spilled()
    assert len(h.tier.index) == 1 and worker_entries(w) == 1
    # Between steps (poll -> housekeeping): the entry's offload.ttl_s is up, domain emptied -> shred
    h.now += 100
    h.tier.sweep(h.now)
    # Next step: vLLM's LRU evicts block 2 (still cached on the device): spill into the same domain
    h.evict([2])
    run_step(h, w)  # worker: spill, drop, shred -> the fresh spill is deleted by the shred
    # The index must describe what the worker holds
    assert len(h.tier.index) == worker_entries(w), (len(h.tier.index), worker_entries(w))


def test_failed_load_emptied_shred_then_spill_next_step_phantom() -> None:
    h = _harness(ttl_s=1000)
    w = _worker()
    req = h.finish("r1", "a", [1, 2, 3], 3)
    h.evict([1])
    run_step(h, w)
    # tamper the one entry
    (entry,) = list(w.tier.tier._entries.values())
    data = bytearray(entry.data)
    data[3] ^= 1
    entry.data = bytes(data)
    again = FakeRequest("r2", req.block_hashes, req.num_tokens)
    assert h.tier.match(again, scope_for("a"), 0, None) == BS
    h.tier.after_alloc(again, [9, 10, 11], BS)
    errors = run_step(h, w)  # load fails (auth) -> emptied -> shred ordered in on_report
    assert errors == {9}
    h.evict([2])  # next step spills into the same domain
    run_step(h, w)
    assert len(h.tier.index) == worker_entries(w), (len(h.tier.index), worker_entries(w))


def test_phantom_then_purge_figures_disagree_with_key_shred() -> None:
    h, w = _one_of_two_spilled()
    h.now += 100
    h.tier.sweep(h.now)
    h.evict([2])
    run_step(h, w)
    h.tier.events.clear()
    figures = h.tier.purge(PurgeSelector(PurgeKind.TENANT, "a"), command_id=5)
    run_step(h, w)
    shreds = [e.details for e in h.tier.events if e.kind is EventKind.KEY_SHRED]
    shown = (
        sum(int(d["entry_count"] or 0) for d in shreds),
        sum(int(d["bytes_deleted"] or 0) for d in shreds),
    )
    assert (figures["tier_entry_count"], figures["tier_bytes"]) == shown, (figures, shreds)


def test_disk_revoked_in_the_same_step_as_a_disk_spill(tmp_path: Any) -> None:
    disk = {"offload": {"allowed": True, "disk": True, "ttl_s": 1000}}
    h = Harness(policies(a=disk), directory=str(tmp_path))
    w = _worker(tmp_path)
    h.finish("r1", "a", [1], 1)
    h.evict([1])  # _record_schedule: a disk spill ordered
    # same build_step, _housekeeping: a policy command revokes offload.disk
    h.policy = policies(a={"offload": {"allowed": True, "disk": False, "ttl_s": 1000}})
    h.tier.on_policy()
    run_step(h, w)
    on_disk = [e for e in w.tier.tier._entries.values() if e.path is not None]
    assert on_disk == [], "a ciphertext file of a tenant whose disk permission was revoked"


def test_sweep_drop_of_a_key_respilled_in_the_same_step_leaves_phantom() -> None:
    h = _harness(ttl_s=100)
    w = _worker()
    req = h.finish("r1", "a", [1, 2], 2)
    h.evict([1])
    run_step(h, w)  # entry K0 stored at t=1000
    h.now += 50
    h.evict([2])
    run_step(h, w)  # entry K1 stored at t=1050 (keeps the domain non-empty later)
    # K0 restored into block 5, then block 5 is cached again for a
    again = FakeRequest("r2", req.block_hashes, req.num_tokens)
    assert h.tier.match(again, scope_for("a"), 0, None) == 2 * BS
    h.tier.after_alloc(again, [5, 6, 7], BS)
    assert run_step(h, w) == set()
    h.pool.blocks[5].block_hash = req.block_hashes[0] + b"\0\0\0\0"
    h.cached.add(5)
    h.tier.note_cached(
        FakeRequest("r2", req.block_hashes, req.num_tokens), scope_for("a"), [5], h.pool
    )
    # build_step at t=1100: _record_schedule evicts block 5 (spill K0), then _housekeeping's
    # sweep drops the old K0 (K1 keeps the domain alive: a drop order, not a shred)
    h.now = 1100.0
    h.evict([5])
    h.tier.sweep(h.now)
    run_step(h, w)
    assert len(h.tier.index) == worker_entries(w), (len(h.tier.index), worker_entries(w))


def test_failed_spill_with_drop_leaves_an_empty_domain_with_a_live_key(monkeypatch: Any) -> None:
    h, w = _one_of_two_spilled()
    h.now += 100
    h.evict([2])  # spill ordered (in _record_schedule) ...
    h.tier.sweep(
        h.now
    )  # ... then the sweep: the domain's only entry expires -> drop (spill pending)
    real_put = w.tier.tier.put

    def failing_put(*a: Any, **k: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(w.tier.tier, "put", failing_put)
    run_step(h, w)
    monkeypatch.setattr(w.tier.tier, "put", real_put)
    for _ in range(3):  # later steps with nothing to do
        run_step(h, w)
    domain = scope_for("a").domain_key
    assert not h.tier.index.has_domain(domain)
    assert domain not in w.tier.keys.domains(), "empty domain kept with a live data key"


def test_a_report_leaves_the_spills_of_the_step_built_after_it_pending() -> None:
    """vLLM's async scheduling (its default on GPU) builds step N+1 before step N's report
    arrives: a report forgets only the spills it answers, so N+1's first spill into a domain is
    neither forgotten nor taken for a failed one (which would shred the domain) and is indexed
    when its own report comes."""
    h = _harness(ttl_s=1000)
    w = _worker()
    h.finish("r1", "a", [1], 1)
    h.evict([1])
    spill, drop, shred, load = h.tier.take_orders()  # step N+1's orders
    assert spill and not shred
    h.tier.on_report(TierReport())  # step N's report
    assert not h.tier.take_orders()[2], "the domain was shredded before its spill was reported"
    _step[0] += 1
    w.on_step(GuardStepMeta(step=_step[0], spill=spill, drop=drop, shred=shred, load=load))
    out = w.take_results()
    assert out is not None and out.tier is not None
    h.tier.on_report(out.tier)
    assert len(h.tier.index) == worker_entries(w) == 1


def _run_orders(worker: WorkerGuard, orders: Any) -> Any:
    """The worker carries out one step's orders; its report (None when it has nothing to say)."""
    spill, drop, shred, load = orders
    _step[0] += 1
    worker.on_step(GuardStepMeta(step=_step[0], spill=spill, drop=drop, shred=shred, load=load))
    out = worker.take_results()
    return out.tier if out is not None else None


def test_a_disk_spill_already_with_the_worker_when_disk_is_revoked_is_not_kept(
    tmp_path: Any,
) -> None:
    """Async scheduling: step N's disk spill is with the worker when step N+1 applies a version
    revoking `offload.disk`; the entry its report brings back is not kept (nor its file)."""
    disk = {"offload": {"allowed": True, "disk": True, "ttl_s": 1000}}
    h = Harness(policies(a=disk), directory=str(tmp_path))
    w = _worker(tmp_path)
    h.finish("r1", "a", [1], 1)
    h.evict([1])
    step_n = h.tier.take_orders()
    assert step_n[0] and step_n[0][0].to_disk
    h.policy = policies(a={"offload": {"allowed": True, "disk": False, "ttl_s": 1000}})
    h.tier.on_policy()  # building step N+1
    step_n1 = h.tier.take_orders()
    report_n = _run_orders(w, step_n)
    _run_orders(w, step_n1)
    assert report_n is not None
    h.tier.on_report(report_n)  # N's report, after N+1 was built
    for _ in range(2):
        report = _run_orders(w, h.tier.take_orders())
        if report is not None:
            h.tier.on_report(report)
    assert [e for e in w.tier.tier._entries.values() if e.path is not None] == []
    assert len(h.tier.index) == worker_entries(w) == 0


def test_a_report_looks_only_at_the_domains_it_is_about() -> None:
    """Checking for domains left empty costs O(the report), not O(domains held) per report."""
    h = Harness(policies(a={"offload": {"allowed": True, "ttl_s": 1000}}), budget=1 << 30)
    w = _worker()

    def spill_one(session: str, position: int) -> Any:
        block_hash = f"{session}-h{position}".encode()
        h.pool.blocks[1].block_hash = block_hash + b"\x00\x00\x00\x00"
        h.cached.add(1)
        hashes = [f"{session}-h{i}".encode() for i in range(position + 1)]
        req = FakeRequest(f"r-{session}", hashes, (position + 1) * BS + 1)
        h.tier.note_cached(req, scope_for("a", session=session), [1], h.pool)
        h.evict([1])
        return _run_orders(w, h.tier.take_orders())

    for i in range(50):  # 50 domains (sessions), one entry each
        report = spill_one(f"s{i}", 0)
        assert report is not None
        h.tier.on_report(report)
    assert len(h.tier.index) == 50
    looked: list[bytes] = []
    emptied = h.tier._emptied
    h.tier._emptied = lambda d: looked.append(d) or emptied(d)  # type: ignore[method-assign]
    report = spill_one("s0", 1)
    assert report is not None
    h.tier.on_report(report)
    assert len(looked) <= 1


def test_a_disk_respill_cancelled_by_a_revoked_disk_leaves_no_phantom(tmp_path: Any) -> None:
    """The worker's disk spill replaced the memory entry at its key; the revocation drops the key:
    the index must forget the old entry too (it counted against the quota, promised a restore that
    missed, and a purge's figures disagreed with its `key.shred`)."""
    mem = {"offload": {"allowed": True, "disk": False, "ttl_s": 1000}}
    disk = {"offload": {"allowed": True, "disk": True, "ttl_s": 1000}}
    h = Harness(
        policies(a=mem), directory=str(tmp_path), restore_us_per_block=1, prefill_us_per_token=100
    )
    w = _worker(tmp_path)
    req = h.finish("r1", "a", [1, 2], 2)
    h.evict([1, 2])
    run_step(h, w)
    assert len(h.tier.index) == worker_entries(w) == 2  # in memory
    h.policy = policies(a=disk)
    h.tier.on_policy()
    h.finish("r2", "a", [5], 1)
    h.evict([5])  # the same hash as block 1, spilled again: to disk
    report = _run_orders(w, h.tier.take_orders())
    h.policy = policies(a=mem)
    h.tier.on_policy()  # disk revoked before the report came back
    assert report is not None
    h.tier.on_report(report)
    run_step(h, w)
    assert len(h.tier.index) == worker_entries(w) == 1  # was: 2 != 1
    assert [e for e in w.tier.tier._entries.values() if e.path is not None] == []
    again = FakeRequest("r3", req.block_hashes, req.num_tokens)
    assert h.tier.match(again, scope_for("a"), 0, None) == 0  # the first block is gone
    h.tier.events.clear()
    figures = h.tier.purge(PurgeSelector(PurgeKind.TENANT, "a"), command_id=7)
    run_step(h, w)
    shreds = [e.details for e in h.tier.events if e.kind is EventKind.KEY_SHRED]
    assert figures["tier_entry_count"] == sum(int(d["entry_count"] or 0) for d in shreds) == 1
    assert figures["tier_bytes"] == sum(int(d["bytes_deleted"] or 0) for d in shreds)
