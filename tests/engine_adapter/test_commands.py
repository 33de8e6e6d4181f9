"""Engine commands through the database: purge and policy kinds, NOTIFY on PostgreSQL, the listener."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from kvguard.engine_adapter.commands import (
    CommandListener,
    CommandQueue,
    PolicyCommand,
    PurgeCommand,
)
from kvguard.engine_adapter.records import PurgeKind, PurgeSelector
from kvguard.errors import ConfigError


def test_purge_and_policy_commands_come_back_in_order(db_url) -> None:
    queue = CommandQueue.open(db_url)
    first = queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
    second = queue.submit_policy(7, requested_by="t")
    third = queue.submit_purge(
        PurgeSelector(PurgeKind.SESSION, "s1", tenant_id="acme"), requested_by="t"
    )
    commands = queue.pending_after(0)
    assert [type(c) for c in commands] == [PurgeCommand, PolicyCommand, PurgeCommand]
    assert [c.id for c in commands] == [first, second, third]
    assert commands[1] == PolicyCommand(second, 7)
    assert commands[2].selector == PurgeSelector(PurgeKind.SESSION, "s1", "acme")
    assert queue.pending_after(second) == [commands[2]]
    queue.acknowledge(second, "e1", {"policy_version": 7})
    assert queue.acks(second)[0]["policy_version"] == 7
    for bad in (0, -1, True, "3"):
        with pytest.raises(ConfigError, match="policy version"):
            queue.submit_policy(bad, requested_by="t")  # type: ignore[arg-type]
    queue.engine.dispose()


def test_listener_refuses_sqlite(sqlite_url) -> None:
    with pytest.raises(ConfigError, match="PostgreSQL"):
        CommandListener(sa.create_engine(sqlite_url))


@pytest.mark.postgres
def test_notify_wakes_the_listener_and_close_is_prompt(pg_url) -> None:
    queue = CommandQueue.open(pg_url)
    listener = CommandListener.open(pg_url).start()
    try:
        assert listener.wait_listening(10.0)
        listener.take()  # the flag raised when LISTEN began
        assert not listener.wait(0.7)  # nothing submitted: no wake-up
        queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
        assert listener.wait(5.0)
        assert listener.take() and not listener.take()  # one flag, cleared by take()
        queue.submit_policy(3, requested_by="t")
        assert listener.wait(5.0)
    finally:
        started = time.monotonic()
        listener.close()
        assert time.monotonic() - started < 2.0
        assert not listener.alive
        queue.engine.dispose()


def _listening_pids(engine: sa.Engine) -> set[int]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN kvguard%' AND datname = current_database()"
                )
            ).scalars()
        )


@pytest.mark.postgres
def test_listener_reconnects_after_its_connection_is_killed(pg_url) -> None:
    queue = CommandQueue.open(pg_url)
    listener = CommandListener.open(pg_url).start()
    try:
        assert listener.wait_listening(10.0)
        (old,) = _listening_pids(queue.engine)
        with queue.engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": old})
        deadline = time.monotonic() + 15
        while not (_listening_pids(queue.engine) - {old}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _listening_pids(queue.engine) - {old}, "the listener did not listen again"
        time.sleep(0.2)
        listener.take()  # the flag raised on reconnecting
        queue.submit_purge(PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t")
        assert listener.wait(5.0)
    finally:
        listener.close()
        queue.engine.dispose()
