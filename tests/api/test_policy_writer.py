"""The API's policy writer (`services.PolicyWriter`): writes that queue while a group is being stored
go together in the next group commit; each waiter gets its own outcome; under concurrent writers
every acknowledged version is stored with its events and command, in order, and conflicts answer
as they would one at a time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
import sqlalchemy as sa

from kvguard.api.services import PolicyWriter
from kvguard.control.commands import CommandQueue
from kvguard.control.db import open_engine
from kvguard.control.outbox import Outbox
from kvguard.control.publish import PolicyOutcome, PolicyPublisher, PolicyWrite
from kvguard.control.schema import EngineCommand, OutboxRow
from kvguard.errors import PermissionDeniedError, PolicyVersionConflictError
from kvguard.policy.store import PolicyChange, PolicyStore
from tests.control.test_publish import _events, _set_ttl


def _write(tenant: str, ttl: int, expected_version: int | None = None) -> PolicyWrite:
    return PolicyWrite(
        _set_ttl(tenant, ttl),
        author=f"key:{tenant}",
        reason="r",
        author_role="admin",
        events=_events,
        expected_version=expected_version,
    )


class _GatedPublisher:
    """Records each group's size; the first group waits until `gate` is set, so that the writes
    sent meanwhile queue behind it."""

    def __init__(self, fail_group: int | None = None) -> None:
        self.groups: list[int] = []
        self.entered = threading.Event()  # the first group is being stored
        self.gate = threading.Event()
        self.fail_group = fail_group

    def publish_group(self, writes: Sequence[PolicyWrite]) -> list[PolicyOutcome]:
        if not self.groups:
            self.entered.set()
            assert self.gate.wait(10)
        self.groups.append(len(writes))
        if len(self.groups) - 1 == self.fail_group:
            raise sa.exc.OperationalError("INSERT", {}, Exception("database gone"))
        out: list[PolicyOutcome] = []
        for write in writes:
            if write.author == "key:refused":
                out.append(PermissionDeniedError("refused"))
            else:
                out.append(PolicyChange(len(out) + 1, write.author, write.reason, "d", 0.0))
        return out


async def _queued(
    writer: PolicyWriter, publisher: _GatedPublisher, writes: list[PolicyWrite]
) -> list[asyncio.Task[object]]:
    """The first write's group being stored (and held), the others queued behind it."""
    tasks: list[asyncio.Task[object]] = [asyncio.create_task(writer.publish(writes[0]))]
    assert await asyncio.to_thread(publisher.entered.wait, 10)
    tasks += [asyncio.create_task(writer.publish(w)) for w in writes[1:]]
    await asyncio.sleep(0.05)  # every task has queued its write
    return tasks


def test_writes_queued_behind_a_group_go_together_in_the_next() -> None:
    publisher = _GatedPublisher()
    writer = PolicyWriter(publisher, max_group=4)  # type: ignore[arg-type]

    async def run() -> list[object]:
        tasks = await _queued(writer, publisher, [_write(f"t{i}", 10) for i in range(7)])
        publisher.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    writer.close()
    assert publisher.groups == [1, 4, 2]  # the first alone, then at most `max_group` at a time
    assert [r.author for r in results if isinstance(r, PolicyChange)] == [
        f"key:t{i}" for i in range(7)
    ]


def test_each_waiter_gets_its_own_outcome() -> None:
    publisher = _GatedPublisher()
    writer = PolicyWriter(publisher)  # type: ignore[arg-type]
    writes = [_write("first", 1), _write("a", 1), _write("refused", 1), _write("b", 1)]

    async def run() -> list[object]:
        tasks = await _queued(writer, publisher, writes)
        publisher.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    writer.close()
    assert isinstance(results[2], PermissionDeniedError)
    assert [r.author for r in results if isinstance(r, PolicyChange)] == [
        "key:first",
        "key:a",
        "key:b",
    ]


def test_a_failed_group_fails_each_of_its_writes_and_the_next_group_runs() -> None:
    publisher = _GatedPublisher(fail_group=1)
    writer = PolicyWriter(publisher)  # type: ignore[arg-type]

    async def run() -> tuple[list[object], object]:
        tasks = await _queued(writer, publisher, [_write(f"t{i}", 10) for i in range(3)])
        publisher.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, await writer.publish(_write("after", 10))

    results, after = asyncio.run(run())
    writer.close()
    assert isinstance(results[0], PolicyChange)
    assert all(isinstance(r, sa.exc.OperationalError) for r in results[1:])
    assert isinstance(after, PolicyChange) and after.author == "key:after"


@pytest.mark.parametrize("writers", [24])
def test_concurrent_writers_keep_every_acknowledged_version_with_its_events(
    any_db: str, writers: int
) -> None:
    """Many writes at once through one writer (one API process): every acknowledged write is a
    stored version with its `policy.change` entry and its command, versions consecutive and in
    the order of their events; a write naming a version that is no longer the latest gets 412
    and stores nothing; each acknowledged tenant edit is in its own version and every later one."""
    engine = open_engine(any_db)
    publisher = PolicyPublisher(PolicyStore(engine), Outbox(engine), CommandQueue(engine))
    writer = PolicyWriter(publisher)
    writes = [_write(f"t{i % 6}", 100 + i) for i in range(writers)]
    writes += [_write("stale", 60, expected_version=0) for _ in range(3)]

    async def run() -> list[object]:
        first = await writer.publish(_write("seed", 50))  # version 1: `expected_version=0` is stale
        assert first.version == 1
        return await asyncio.gather(*(writer.publish(w) for w in writes), return_exceptions=True)

    results = asyncio.run(run())
    writer.close()
    stored = [r for r in results if isinstance(r, PolicyChange)]
    assert len(stored) == writers
    assert all(isinstance(r, PolicyVersionConflictError) for r in results[writers:])
    assert sorted(c.version for c in stored) == list(range(2, writers + 2))
    store = PolicyStore(open_engine(any_db))
    assert [c.version for c in store.history()] == list(range(1, writers + 2))
    for i, change in enumerate(stored):
        for version in range(change.version, writers + 2):
            # The write's own edit, unless a later write of the same tenant replaced it.
            later = [
                c.version
                for j, c in enumerate(stored)
                if j % 6 == i % 6 and change.version < c.version <= version
            ]
            if not later:
                assert store.get(version).policy.policy_for(f"t{i % 6}").retention.ttl_s == 100 + i
    with engine.connect() as conn:
        events = conn.execute(sa.select(OutboxRow.event).order_by(OutboxRow.id)).scalars().all()
        commands = conn.execute(
            sa.select(EngineCommand.selector_value).order_by(EngineCommand.seq)
        ).scalars()
        assert list(commands) == [str(v) for v in range(1, writers + 2)]
    changes = [e for e in events if '"policy.change"' in e]
    assert len(changes) == writers + 1 and len(events) == 2 * (writers + 1)
    engine.dispose()
