"""One-statement admin writes (`kvguard.control.publish`): a policy version with its engine command
and outbox events, all or nothing; a compare-and-set on the policy head that never loses another
process's version; purges with their events."""

from __future__ import annotations

import json
import random
import re
import threading
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from kvguard.audit.events import AuditEvent, EventKind
from kvguard.control.commands import CommandQueue, PolicyCommand, PurgeKind, PurgeSelector
from kvguard.control.db import open_engine
from kvguard.control.outbox import Outbox
from kvguard.control.policy_seed import policy_change_event
from kvguard.control.publish import PolicyBase, PolicyPublisher, PolicyWrite, submit_purge
from kvguard.control.schema import EngineCommand, OutboxRow, PolicyVersionRow
from kvguard.control.tenants import TenantRegistry
from kvguard.errors import (
    PermissionDeniedError,
    PolicyVersionConflictError,
    PreconditionRequiredError,
)
from kvguard.policy import PolicySet, TenantPolicy
from kvguard.policy.store import PolicyChange, PolicyStore


def _publisher(url: str) -> PolicyPublisher:
    """A publisher as one API process holds it (a second one stands for another process)."""
    engine = open_engine(url)
    return PolicyPublisher(PolicyStore(engine), Outbox(engine), CommandQueue(engine))


def _set_ttl(tenant: str, ttl: int):  # type: ignore[no-untyped-def]
    def edit(base: PolicyBase) -> PolicySet:
        policy_set = base.current.policy if base.current else PolicySet()
        entry = TenantPolicy.model_validate({"retention": {"ttl_s": ttl, "idle_s": 10}})
        return PolicySet.model_validate(
            {**policy_set.model_dump(mode="json"), "tenants": {**policy_set.tenants, tenant: entry}}
        )

    return edit


def _events(change: PolicyChange) -> list[AuditEvent]:
    marker = AuditEvent(
        kind=EventKind.ADMIN_ACTION,
        ts=datetime.fromtimestamp(change.at, UTC),
        details={"action": "test", "policy_version": change.version},
    )
    return [policy_change_event(change), marker]


def _publish(publisher: PolicyPublisher, tenant: str, ttl: int, **kw: object) -> PolicyChange:
    return publisher.publish(
        _set_ttl(tenant, ttl),
        author="key:a",
        reason="r",
        author_role="admin",
        events=_events,
        **kw,  # type: ignore[arg-type]
    )


def _rows(url: str) -> tuple[list[dict[str, object]], list[tuple[str, str]]]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        events = [
            json.loads(e)
            for e in conn.execute(sa.select(OutboxRow.event).order_by(OutboxRow.id)).scalars()
        ]
        commands = [
            (r.kind, r.selector_value)
            for r in conn.execute(
                sa.select(EngineCommand.kind, EngineCommand.selector_value).order_by(
                    EngineCommand.seq
                )
            )
        ]
    engine.dispose()
    return events, commands


def test_a_version_commits_with_its_command_and_events_in_order(db_url: str) -> None:
    publisher = _publisher(db_url)
    first = _publish(publisher, "acme", 100)
    second = _publish(publisher, "globex", 200)
    assert (first.version, second.version) == (1, 2)
    events, commands = _rows(db_url)
    assert [e["kind"] for e in events] == ["policy.change", "admin.action"] * 2
    assert [e["details"]["policy_version"] for e in events] == [1, 1, 2, 2]
    assert commands == [("policy", "1"), ("policy", "2")]
    command = CommandQueue.open(db_url).pending_after(0)[1]
    assert isinstance(command, PolicyCommand) and command.version == 2


def test_another_process_version_is_edited_never_reverted(db_url: str) -> None:
    """Process A remembers version 1 as its base; process B stores version 2; A's next write must
    edit version 2 (on PostgreSQL its compare-and-set finds the head moved and it starts again)."""
    a, b = _publisher(db_url), _publisher(db_url)
    _publish(a, "acme", 100)
    _publish(b, "globex", 200)
    third = _publish(a, "acme", 150)
    assert third.version == 3
    latest = PolicyStore(open_engine(db_url)).get(3).policy
    assert latest.policy_for("globex").retention.ttl_s == 200
    assert latest.policy_for("acme").retention.ttl_s == 150
    events, commands = _rows(db_url)
    assert len(events) == 6 and len(commands) == 3  # the redone write left nothing extra


def test_concurrent_publishers_of_several_processes_lose_nothing(db_url: str) -> None:
    publishers = [_publisher(db_url) for _ in range(3)]
    errors: list[BaseException] = []

    def write(publisher: PolicyPublisher, tenant: str) -> None:
        try:
            for i in range(5):
                _publish(publisher, tenant, 100 + i)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(p, f"t{n}")) for n, p in enumerate(publishers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    store = PolicyStore(open_engine(db_url))
    assert [c.version for c in store.history()] == list(range(1, 16))
    final = store.get(15).policy
    assert {t: final.policy_for(t).retention.ttl_s for t in ("t0", "t1", "t2")} == {
        "t0": 104,
        "t1": 104,
        "t2": 104,
    }
    events, commands = _rows(db_url)
    assert len(events) == 30 and len(commands) == 15


def test_an_expected_version_that_is_not_the_latest_stores_nothing(db_url: str) -> None:
    a, b = _publisher(db_url), _publisher(db_url)
    _publish(a, "acme", 100, expected_version=0)
    _publish(b, "acme", 90, expected_version=1)
    with pytest.raises(PolicyVersionConflictError):
        _publish(a, "acme", 80, expected_version=1)  # A still remembers version 1
    assert _publish(a, "acme", 80, expected_version=2).version == 3
    events, commands = _rows(db_url)
    assert len(events) == 6 and len(commands) == 3


def test_an_edit_that_refuses_stores_nothing(db_url: str) -> None:
    publisher = _publisher(db_url)

    def refuse(_base: PolicyBase) -> PolicySet:
        raise PermissionDeniedError("no")

    with pytest.raises(PermissionDeniedError):
        publisher.publish(refuse, author="a", reason="r", author_role="admin", events=_events)
    assert _rows(db_url) == ([], [])
    assert PolicyStore(open_engine(db_url)).current() is None


def test_the_limits_are_those_of_the_version_edited(db_url: str) -> None:
    """The base's limits are the latest admin-written version at or below the base: a tenant_admin
    version on top does not move them, an admin version does."""
    publisher = _publisher(db_url)
    _publish(publisher, "acme", 100)
    publisher.publish(
        _set_ttl("acme", 50), author="key:t", reason="r", author_role="tenant_admin", events=_events
    )
    seen: list[tuple[int, int | None]] = []

    def record(base: PolicyBase) -> PolicySet:
        seen.append((base.version, base.limits.change.version if base.limits else None))
        return _set_ttl("acme", 40)(base)

    publisher.publish(
        record, author="key:t", reason="r", author_role="tenant_admin", events=_events
    )
    publisher.forget()
    publisher.publish(
        record, author="key:t", reason="r", author_role="tenant_admin", events=_events
    )
    assert seen == [(2, 1), (3, 1)]


def test_a_tenants_limits_are_those_its_latest_admin_write_set_whichever_process_wrote_it(
    db_url: str,
) -> None:
    """A tenant_admin's write is checked against the entry of the latest admin version that set
    its tenant's limits, whichever process wrote that version, each time a newer one exists (the
    limits are kept per version, never per tenant alone)."""
    one, two = _publisher(db_url), _publisher(db_url)
    seen: list[int] = []  # the limit each edit saw (an edit over a stale base is redone)
    checked: list[tuple[str, int]] = []  # the limit the stored version was checked against

    def admin_sets(tenant: str, ttl: int) -> PolicyWrite:
        return PolicyWrite(_set_ttl(tenant, ttl), "key:a", "r", "admin", _events, limits_of=tenant)

    def tenant_admin(base: PolicyBase) -> PolicySet:
        seen.append(base.limit_for("acme").retention.ttl_s)
        return _set_ttl("acme", 20)(base)

    def publish(publisher: PolicyPublisher, write: PolicyWrite | None = None) -> None:
        write = write or PolicyWrite(tenant_admin, "key:t", "r", "tenant_admin", _events)
        outcome = publisher.publish_group([write])[0]
        assert not isinstance(outcome, Exception), outcome
        if write.author_role == "tenant_admin":
            checked.append(("one" if publisher is one else "two", seen[-1]))

    publish(one, admin_sets("acme", 100))
    publish(two)
    publish(one)
    publish(one, admin_sets("acme", 60))
    publish(two)
    publish(two, admin_sets("beta", 10))  # another tenant's limits leave acme's alone
    publish(one)
    publish(two, admin_sets("acme", 30))
    publish(two)
    publish(one)
    publish(one)
    assert checked == [
        ("two", 100),
        ("one", 100),
        ("two", 60),
        ("one", 60),
        ("two", 30),
        ("one", 30),
        ("one", 30),
    ]


def test_a_process_checks_against_limits_it_wrote_without_reading_them_back(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = _publisher(db_url)
    write = PolicyWrite(_set_ttl("acme", 100), "key:a", "r", "admin", _events, limits_of="acme")
    assert not isinstance(publisher.publish_group([write])[0], Exception)
    others = [  # more versions than the store keeps parsed: the limits' version is long gone
        PolicyWrite(_set_ttl(f"t{n}", 50), "key:o", "r", "tenant_admin", _events) for n in range(80)
    ]
    assert not any(isinstance(o, Exception) for o in publisher.publish_group(others))
    reads: list[int] = []
    real = PolicyStore._to_version

    def counting(self: PolicyStore, row: object) -> object:
        reads.append(row.version)  # type: ignore[attr-defined]
        return real(self, row)

    monkeypatch.setattr(PolicyStore, "_to_version", counting)
    publisher.forget()  # the base is read again, as after another process's write
    limits: list[int] = []

    def tenant_admin(base: PolicyBase) -> PolicySet:
        limits.append(base.limit_for("acme").retention.ttl_s)
        return _set_ttl("acme", 20)(base)

    mine = PolicyWrite(tenant_admin, "key:t", "r", "tenant_admin", _events)
    assert not isinstance(publisher.publish_group([mine])[0], Exception)
    assert limits == [100]
    assert reads == []  # neither the base nor the limits' version was read back


def test_a_purge_commits_with_its_events_naming_the_job(db_url: str) -> None:
    engine = open_engine(db_url)
    queue, outbox = CommandQueue(engine), Outbox(engine)

    def events(job_id: int) -> list[AuditEvent]:
        return [
            AuditEvent(
                kind=EventKind.ADMIN_ACTION,
                ts=datetime.now(UTC),
                details={"action": "purge.create", "job_id": job_id},
            )
        ]

    first = submit_purge(
        queue, outbox, PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="k", events=events
    )
    second = submit_purge(
        queue,
        outbox,
        PurgeSelector(PurgeKind.SESSION, "s1", tenant_id="acme"),
        requested_by="k",
        events=events,
    )
    stored, commands = _rows(db_url)
    assert [e["details"]["job_id"] for e in stored] == [first, second]
    assert commands == [("purge", "acme"), ("purge", "s1")]
    assert [c.id for c in queue.pending_after(0)] == [first, second]


def _reference_limit(url: str, tenant: str, after: int, upto: int) -> int | None:
    """The TTL of `tenant`'s entry in its latest admin version in (`after`, `upto`], read from the
    rows themselves by a store of its own (None: there is none)."""
    engine = open_engine(url)
    try:
        with engine.connect() as conn:
            version = conn.execute(
                sa.select(sa.func.max(PolicyVersionRow.version)).where(
                    PolicyVersionRow.limits_of == tenant,
                    PolicyVersionRow.version > after,
                    PolicyVersionRow.version <= upto,
                )
            ).scalar()
        if version is None:
            return None
        return PolicyStore(engine).get(version).policy.policy_for(tenant).retention.ttl_s
    finally:
        engine.dispose()


def test_tenant_limits_found_without_a_query_are_those_the_rows_give(db_url: str) -> None:
    """Two processes write admin edits of one tenant, admin edits of all, and tenant_admin
    tightenings in a random order; each store's answer for every tenant and range (stale ones
    included) is what the rows give, whether it came from what the process learnt from its base
    reads and commits or from a query."""
    rng = random.Random(7)
    one, two = _publisher(db_url), _publisher(db_url)
    tenants = ["acme", "beta", "gamma"]
    for step in range(60):
        publisher = rng.choice([one, two])
        kind = rng.random()
        tenant = rng.choice(tenants)
        if kind < 0.35:
            write = PolicyWrite(
                _set_ttl(tenant, rng.randint(30, 900)),
                "key:a",
                "r",
                "admin",
                _events,
                limits_of=tenant,
            )
        elif kind < 0.45:
            write = PolicyWrite(
                _set_ttl(tenant, rng.randint(30, 900)), "key:a", "r", "admin", _events
            )
        else:
            write = PolicyWrite(_set_ttl(tenant, 20), "key:t", "r", "tenant_admin", _events)
        assert not isinstance(publisher.publish_group([write])[0], Exception)
        if step % 6:
            continue
        latest = step + 1
        for store in (one._store, two._store):
            for name in tenants:
                for after, upto in [(0, latest), (latest // 2, latest), (0, latest // 2)]:
                    found = store.tenant_limit(name, after, upto)
                    expected = _reference_limit(db_url, name, after, upto)
                    assert (found.retention.ttl_s if found else None) == expected, (
                        name,
                        after,
                        upto,
                    )


def test_a_contended_tenant_admin_write_reads_no_limits_of_its_own(db_url: str) -> None:
    """When the other process moved the head, the base read already names the admin versions
    that set one tenant's limits: a tenant_admin's write sends no query for its tenant's limits
    (the code before sent one per tenant_admin write after every fresh base read)."""
    one, two = _publisher(db_url), _publisher(db_url)
    for tenant in ("acme", "beta"):
        write = PolicyWrite(_set_ttl(tenant, 300), "key:a", "r", "admin", _events, limits_of=tenant)
        assert not isinstance(two.publish_group([write])[0], Exception)
    statements: list[str] = []

    def record(*args: object) -> None:
        statements.append(str(args[2]))

    engine = one._store.engine
    sa.event.listen(engine, "before_cursor_execute", record)
    limits: list[int] = []

    def tenant_admin(tenant: str):  # type: ignore[no-untyped-def]
        def edit(base: PolicyBase) -> PolicySet:
            limits.append(base.limit_for(tenant).retention.ttl_s)
            return _set_ttl(tenant, 20)(base)

        return edit

    for n in range(6):
        tenant = ("acme", "beta")[n % 2]
        write = PolicyWrite(tenant_admin(tenant), "key:t", "r", "tenant_admin", _events)
        assert not isinstance(one.publish_group([write])[0], Exception)
        other = PolicyWrite(
            _set_ttl("gamma", 100 + n), "key:a", "r", "admin", _events, limits_of="gamma"
        )
        assert not isinstance(two.publish_group([other])[0], Exception)
    sa.event.remove(engine, "before_cursor_execute", record)
    assert limits and set(limits) == {300}  # an edit over a stale base is redone
    # `tenant_limit`'s query: the latest version whose `limits_of` is the tenant, `LIMIT 1`
    per_tenant = [s for s in statements if "limits_of =" in s and re.search(r"\bLIMIT\b", s)]
    assert per_tenant == []


def _set_enabled(tenant: str, enabled: bool):  # type: ignore[no-untyped-def]
    def edit(base: PolicyBase) -> PolicySet:
        policy_set = base.current.policy if base.current else PolicySet()
        entry = TenantPolicy(enabled=enabled)
        return PolicySet.model_validate(
            {**policy_set.model_dump(mode="json"), "tenants": {**policy_set.tenants, tenant: entry}}
        )

    return edit


def _write(edit, **kw: object) -> PolicyWrite:  # type: ignore[no-untyped-def]
    return PolicyWrite(edit, "key:a", "r", "admin", _events, **kw)  # type: ignore[arg-type]


def test_a_version_that_re_enables_a_tenant_ends_its_registry_disable_in_its_transaction(
    db_url: str,
) -> None:
    """A re-enable's registry update commits with the version (`publish.reenabled`): as a second
    transaction after it, a crash in between left the registry saying disabled (the next disable
    refused as "already disabled") while engines served the tenant. A version that is not stored
    ends no disable. One version alone (PostgreSQL: one autocommit statement) and a group of
    several (one pipelined transaction)."""
    publisher = _publisher(db_url)
    registry = TenantRegistry(open_engine(db_url))
    tenants = ("acme", "globex", "initech")
    for tenant in tenants:
        registry.create(tenant, display_name=tenant, created_by="test")
        registry.disable(tenant, by="key:a", reason="test")
    outcomes = publisher.publish_group([_write(_set_enabled(t, False)) for t in tenants])
    assert all(isinstance(o, PolicyChange) for o in outcomes)
    latest = outcomes[-1].version  # type: ignore[union-attr]

    refused = publisher.publish_group([_write(_set_enabled("acme", True), expected_version=1)])
    assert isinstance(refused[0], PolicyVersionConflictError)
    assert not registry.get("acme").enabled  # nothing stored, nothing ended

    publisher.publish_group([_write(_set_enabled("acme", True), expected_version=latest)])
    assert registry.get("acme").enabled
    assert not registry.get("globex").enabled and not registry.get("initech").enabled
    # A re-enable names the version it edits (`_require_precondition`), also inside a group.
    group = [_write(_set_enabled("globex", True), expected_version=latest + 1)]
    group.append(_write(_set_ttl("x", 50)))
    group.append(_write(_set_enabled("initech", True), expected_version=latest + 3))
    stored = publisher.publish_group(group)
    assert all(isinstance(o, PolicyChange) for o in stored), stored
    assert registry.get("globex").enabled and registry.get("initech").enabled
    registry.disable("globex", by="key:a", reason="again")  # not refused as "already disabled"


def test_a_re_enable_over_a_version_whose_default_disables_the_tenant_ends_its_disable(
    db_url: str,
) -> None:
    """The base disables the tenant through its default, not an entry of its own: the version that
    enables it by an entry still ends the registry's disable (`reenabled` reads `policy_for`)."""
    publisher = _publisher(db_url)
    registry = TenantRegistry(open_engine(db_url))
    registry.create("acme", display_name="acme", created_by="test")
    registry.disable("acme", by="key:a", reason="test")
    off = PolicySet.model_validate({"default": {"enabled": False}})
    publisher.publish_group([_write(lambda base: off)])
    publisher.publish_group([_write(_set_enabled("acme", True), expected_version=1)])
    assert registry.get("acme").enabled
    registry.disable("acme", by="key:a", reason="again")  # not refused as "already disabled"


def test_a_re_enable_must_name_the_version_it_edits(db_url: str) -> None:
    """A document read before a disable (every entry printed with `enabled: true`) and written back
    after it would undo the disable without a word (found by a review): a version that re-enables a
    tenant, or every tenant through the default, is refused 428 unless it names the version it
    edits; nothing is stored and the registry's disable stays. With the version named it is a
    deliberate re-enable."""
    publisher = _publisher(db_url)
    registry = TenantRegistry(open_engine(db_url))
    registry.create("acme", display_name="acme", created_by="test")
    registry.disable("acme", by="key:a", reason="test")
    first = publisher.publish_group([_write(_set_enabled("acme", False))])[0]
    assert isinstance(first, PolicyChange)
    stale = PolicySet.model_validate({"tenants": {"acme": {"enabled": True}, "globex": {}}})
    refused = publisher.publish_group([_write(lambda base: stale)])
    assert isinstance(refused[0], PreconditionRequiredError), refused
    assert "acme" in str(refused[0]) and "If-Match" in str(refused[0])
    assert not registry.get("acme").enabled
    assert publisher.publish_group([_write(_set_ttl("x", 50))])[0].version == 2  # type: ignore[union-attr]
    off = PolicySet.model_validate({"default": {"enabled": False}})
    assert isinstance(publisher.publish_group([_write(lambda base: off)])[0], PolicyChange)
    back = publisher.publish_group([_write(lambda base: PolicySet())])
    assert isinstance(back[0], PreconditionRequiredError) and "default" in str(back[0])
    stored = publisher.publish_group([_write(lambda base: stale, expected_version=3)])
    assert isinstance(stored[0], PolicyChange)
    assert registry.get("acme").enabled
