"""`Deliverer.deliver_async`: an API write awaits the outbox drain on the event loop, with the same
guarantee as `deliver` (a drain that started after the call, so its own committed rows are in it),
grouped with the other writers, and False (never raised, never hung) when the drain fails, the
deliverer stops, or the wait times out."""

from __future__ import annotations

import asyncio
import threading
import time

import structlog

from kvguard.control.outbox import Deliverer
from kvguard.errors import AuditError, LedgerUnavailableError


def test_awaited_writers_are_served_by_a_drain_that_started_after_them() -> None:
    passes: list[float] = []

    def drain() -> None:
        passes.append(time.monotonic())
        time.sleep(0.02)  # a ledger transaction

    deliverer = Deliverer(drain, interval_s=None)

    async def writer() -> tuple[float, bool]:
        called = time.monotonic()
        return called, await deliverer.deliver_async()

    async def run() -> list[tuple[float, bool]]:
        results = []
        for _ in range(4):  # waves: each arrives while the previous drain may still run
            results += await asyncio.gather(*(writer() for _ in range(10)))
        return results

    results = asyncio.run(run())
    deliverer.close()
    assert [ok for _, ok in results] == [True] * 40
    assert len(passes) < 40  # grouped, not one drain per writer
    for called, _ok in results:
        assert any(p >= called for p in passes)


def test_threads_and_awaiters_share_the_drains() -> None:
    drained = threading.Event()

    def drain() -> None:
        drained.set()
        time.sleep(0.01)

    deliverer = Deliverer(drain, interval_s=None)
    threaded: list[bool] = []
    thread = threading.Thread(target=lambda: threaded.append(deliverer.deliver()))
    thread.start()

    async def run() -> list[bool]:
        return list(await asyncio.gather(*(deliverer.deliver_async() for _ in range(5))))

    assert asyncio.run(run()) == [True] * 5
    thread.join(10)
    deliverer.close()
    assert threaded == [True] and drained.is_set()


def test_a_failed_drain_answers_false_to_awaiters() -> None:
    failing = Deliverer(lambda: 1 / 0, interval_s=None)
    assert asyncio.run(failing.deliver_async()) is False  # reported, not raised
    failing.close()


def test_a_ledger_refusal_is_logged_as_an_error_with_its_reason_an_outage_as_a_warning() -> None:
    def refused() -> None:
        raise AuditError(
            "2 of 5 outbox rows were delivered by a writer that does not hold the lock"
        )

    def outage() -> None:
        raise LedgerUnavailableError("ledger down")

    with structlog.testing.capture_logs() as logs:
        for drain in (refused, outage):
            deliverer = Deliverer(drain, interval_s=None)
            assert deliverer.deliver() is False
            deliverer.close()
    (error,) = [e for e in logs if e["log_level"] == "error"]
    assert error["event"] == "ledger delivery refused" and "2 of 5 outbox rows" in error["error"]
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "ledger delivery deferred"
    assert warning["error_type"] == "LedgerUnavailableError"


def test_a_stopped_deliverer_answers_false_at_once() -> None:
    deliverer = Deliverer(lambda: None, interval_s=None)
    deliverer.close()
    assert asyncio.run(asyncio.wait_for(deliverer.deliver_async(), 1)) is False


def test_an_awaiter_gives_up_after_its_timeout() -> None:
    release = threading.Event()
    deliverer = Deliverer(lambda: release.wait(10), interval_s=None)

    async def run() -> bool:
        return await deliverer.deliver_async(timeout=0.1)

    started = time.monotonic()
    assert asyncio.run(run()) is False
    assert time.monotonic() - started < 5
    release.set()
    deliverer.close()


def test_closing_answers_the_awaiters_still_waiting() -> None:
    release = threading.Event()
    deliverer = Deliverer(lambda: release.wait(10), interval_s=None)

    async def run() -> list[bool]:
        first = asyncio.ensure_future(deliverer.deliver_async())
        await asyncio.sleep(0.05)  # its drain is running (and held)
        second = asyncio.ensure_future(deliverer.deliver_async())  # waits for the next drain
        await asyncio.sleep(0.05)
        closer = asyncio.get_running_loop().run_in_executor(None, deliverer.close, 10.0)
        await asyncio.sleep(0.05)
        release.set()
        await closer
        return [await first, await second]

    # Answered, not left hanging: False, as `deliver` answers a caller once the deliverer stops
    # (the rows stay committed in the outbox for the next process's drain).
    assert asyncio.run(run()) == [False, False]
