"""Issue 11: admin writes are one transaction with their engine commands and ledger events; policy
writes never lose each other's updates; a tenant_admin only tightens what the admin set."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from kvguard.api.app import create_app
from kvguard.api.services import Services
from kvguard.audit.events import EventKind
from kvguard.control.schema import OutboxRow, TenantRow
from kvguard.errors import LedgerUnavailableError
from tests.api.conftest import ApiEnv
from tests.api.purge_support import SimEngine, scope

POLICY = "/v1/tenants/{}/policy"


def _raw_put(
    env: ApiEnv, who: str, path: str, headers: dict[bytes, bytes]
) -> tuple[int, dict[str, Any]]:
    """PUT `{"policy": {}, "reason": "r"}` with header bytes as a server passes them (httpx
    re-encodes non-ASCII ones): straight to the ASGI app."""
    body = json.dumps({"policy": {}, "reason": "r"}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "PUT",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", f"Bearer {env.keys[who]}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers.items(),
        ],
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    anyio.run(env.client.app, scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return int(start["status"]), json.loads(text)


def _put(env: ApiEnv, who: str, tenant: str, policy: dict[str, Any], **kw: Any) -> Any:
    return env.call(who, "PUT", POLICY.format(tenant), json={"policy": policy, "reason": "r"}, **kw)


def _entries(env: ApiEnv, kind: str) -> list[dict[str, Any]]:
    env.services.deliver()
    with env.services.ledger.store.engine.connect() as conn:
        leaves = conn.execute(
            sa.text("SELECT leaf FROM ledger_entries WHERE kind = :k ORDER BY idx"), {"k": kind}
        ).scalars()
        return [json.loads(bytes(leaf)) for leaf in leaves]


# --- lost updates ---------------------------------------------------------------------------------


def test_concurrent_tenant_writers_never_revert_each_other(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    """Two tenant_admins and an admin write at once; between consecutive versions only the writer's
    own tenant entry may change (0.1.0: 39 of 144 versions reverted the other tenant's change)."""
    env = make_env(any_db)
    writers = [("acme", "acme"), ("globex", "globex"), ("admin", "acme"), ("admin", "globex")]
    errors: list[str] = []

    def write(who: str, tenant: str, n: int) -> None:
        for i in range(n):
            ttl = 100 + i if who != "admin" else 3000 - i
            r = _put(env, who, tenant, {"retention": {"ttl_s": ttl, "idle_s": 10}})
            if r.status_code != 201:
                errors.append(f"{who}/{tenant}: {r.status_code} {r.text}")

    threads = [
        threading.Thread(target=write, args=(who, tenant, 6))
        for who, tenant in writers
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # tenant_admins may be refused when they would loosen the admin's newest limit: that is
    # a clean 403, never a lost update.
    assert all(" 403 " in e for e in errors), errors
    store = env.services.policies
    history = store.history()
    assert [c.version for c in history] == list(range(1, len(history) + 1))
    previous = None
    for change in history:
        version = store.get(change.version)
        if previous is not None:
            touched = {
                t
                for t in set(version.policy.tenants) | set(previous.tenants)
                if version.policy.tenants.get(t) != previous.tenants.get(t)
            }
            assert len(touched) <= 1, f"version {change.version} changed {touched}"
        previous = version.policy


def test_admin_disable_is_never_undone_by_the_tenants_own_writes(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    done = threading.Event()

    def tenant_writes() -> None:
        i = 0
        while not done.is_set() and i < 60:
            _put(env, "acme", "acme", {"retention": {"ttl_s": 100 + i % 50, "idle_s": 10}})
            i += 1

    writer = threading.Thread(target=tenant_writes)
    writer.start()
    r = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "incident"})
    assert r.status_code == 200, r.text
    done.set()
    writer.join(60)
    current = env.services.policies.current()
    assert current is not None and current.policy.policy_for("acme").enabled is False
    refused = _put(env, "acme", "acme", {"enabled": True, "retention": {"ttl_s": 5, "idle_s": 5}})
    assert refused.status_code == 403


def test_if_match_guards_a_read_modify_write(make_env: Callable[..., ApiEnv], any_db: str) -> None:
    env = make_env(any_db)
    got = env.call("admin", "GET", "/v1/policies/current")
    assert got.headers["ETag"] == '"0"'
    body = {"policy": got.json()["policy"], "reason": "first"}
    first = env.call("admin", "PUT", "/v1/policies", json=body, headers={"If-Match": '"0"'})
    assert first.status_code == 201 and first.headers["ETag"] == '"1"'
    stale = env.call("admin", "PUT", "/v1/policies", json=body, headers={"If-Match": '"0"'})
    assert stale.status_code == 412 and stale.json()["error"] == "precondition_failed"
    by_body = env.call("admin", "PUT", "/v1/policies", json={**body, "expected_version": 0})
    assert by_body.status_code == 412
    tenant = env.call("admin", "GET", POLICY.format("acme"))
    assert tenant.headers["ETag"] == '"1"'
    ok = _put(env, "admin", "acme", {"audit": "full"}, headers={"If-Match": '"1"'})
    assert ok.status_code == 201
    assert [c.version for c in env.services.policies.history()] == [1, 2]
    garbage = _put(env, "admin", "acme", {}, headers={"If-Match": "yesterday"})
    assert garbage.status_code == 412
    # Latin-1 bytes str.isdigit() takes for digits (`²`, `¹`), which int() refuses: a 412, not a
    # 422 that echoed the header (found by a review).
    for raw in (b'"\xb2"', b"\xb9"):
        status, answer = _raw_put(env, "admin", POLICY.format("acme"), {b"if-match": raw})
        assert status == 412, answer
        assert "If-Match must be a policy version ETag" in answer["message"]
    # The current version's tag, but weak: If-Match compares strongly, so it never matches.
    assert _put(env, "admin", "acme", {}, headers={"If-Match": 'W/"2"'}).status_code == 412
    assert (
        _put(env, "admin", "acme", {"audit": "full"}, headers={"If-Match": "*"}).status_code == 201
    )
    # Every refused write left nothing behind: no version, no command, no policy.change entry.
    assert len(_entries(env, EventKind.POLICY_CHANGE.value)) == 3
    assert [c.version for c in env.services.commands.pending_after(0) if hasattr(c, "version")] == [
        1,
        2,
        3,
    ]


# --- tenant_admin limits --------------------------------------------------------------------------

ADMIN_LIMITS = {
    "classification": "internal",
    "reuse": "session",
    "retention": {"ttl_s": 600, "idle_s": 120},
    "quota": {"max_blocks": 64},
    "zeroize": {"on_release": "always", "verify": "sample"},
    "audit": "standard",
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"classification": "public"}, "classification"),
        ({"reuse": "tenant"}, "reuse"),
        ({"retention": {"ttl_s": 601, "idle_s": 120}}, "retention.ttl_s"),
        ({"retention": {"ttl_s": 600, "idle_s": 121}}, "retention.idle_s"),
        ({"quota": {"max_blocks": None}}, "quota.max_blocks"),
        ({"quota": {"max_blocks": 65}}, "quota.max_blocks"),
        ({"zeroize": {"on_release": "cross_scope", "verify": "sample"}}, "zeroize.on_release"),
        ({"zeroize": {"on_release": "always", "verify": "none"}}, "zeroize.verify"),
        ({"audit": "minimal"}, "audit"),
    ],
)
def test_a_tenant_admin_cannot_loosen_what_the_admin_set(
    make_env: Callable[..., ApiEnv], change: dict[str, Any], field: str
) -> None:
    env = make_env()
    assert _put(env, "admin", "acme", ADMIN_LIMITS).status_code == 201
    r = _put(env, "acme", "acme", {**ADMIN_LIMITS, **change})
    assert r.status_code == 403 and field in r.json()["message"], r.text
    assert len(env.services.policies.history()) == 1


def test_a_tenant_admin_may_tighten_and_relax_back_to_the_limit(
    make_env: Callable[..., ApiEnv], tmp_path: Path
) -> None:
    env = make_env()
    assert _put(env, "admin", "acme", ADMIN_LIMITS).status_code == 201
    tighter = {
        **ADMIN_LIMITS,
        "classification": "confidential",
        "reuse": "none",
        "retention": {"ttl_s": 60, "idle_s": 30},
        "quota": {"max_blocks": 8},
        "zeroize": {"on_release": "always", "verify": "full"},
        "audit": "full",
    }
    assert _put(env, "acme", "acme", tighter).status_code == 201
    # Back up to (not past) the admin's limits: the limits are the admin's version, not the last.
    assert _put(env, "acme", "acme", ADMIN_LIMITS).status_code == 201
    assert _put(env, "acme", "acme", {**ADMIN_LIMITS, "audit": "minimal"}).status_code == 403
    # With no admin version at all, the built-in defaults are the limits.
    fresh = make_env(f"sqlite:///{tmp_path / 'fresh.db'}")
    assert _put(fresh, "acme", "acme", {"audit": "minimal"}).status_code == 403
    assert _put(fresh, "acme", "acme", {"audit": "full"}).status_code == 201


TIGHTER = {**ADMIN_LIMITS, "retention": {"ttl_s": 60, "idle_s": 30}, "audit": "full"}


def test_an_admin_write_of_another_tenant_leaves_a_tenant_admins_limits_alone(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    """The limits are what an admin last set for *this* tenant: an admin's edit of another
    tenant's entry, or another tenant's disable, stores a whole new version that carries acme's own
    tightening forward, and that must not become acme's limits (reviewer's finding). Checked by
    this process and by a second one on the same database (which reads the limits afresh)."""
    env = make_env(any_db)
    assert _put(env, "admin", "acme", ADMIN_LIMITS).status_code == 201
    assert _put(env, "acme", "acme", TIGHTER).status_code == 201
    assert (
        _put(env, "admin", "globex", {"retention": {"ttl_s": 100, "idle_s": 10}}).status_code == 201
    )
    disabled = env.call("admin", "POST", "/v1/tenants/globex/disable", json={"reason": "x"})
    assert disabled.status_code == 200
    assert _put(env, "acme", "acme", ADMIN_LIMITS).status_code == 201  # back up to the limit
    assert _put(env, "acme", "acme", TIGHTER).status_code == 201
    with _second_process(env) as other:  # no base, no remembered limits
        _relax_and_reset(env, other)
    rows = _limits_of(env)
    assert set(rows) == {"*", "acme", "globex", "-"}


def _relax_and_reset(env: ApiEnv, other: ApiEnv) -> None:
    assert _put(other, "acme", "acme", ADMIN_LIMITS).status_code == 201
    looser = _put(other, "acme", "acme", {**ADMIN_LIMITS, "audit": "minimal"})
    assert looser.status_code == 403 and "audit" in looser.json()["message"], looser.text
    # An admin's edit of acme's own entry moves acme's limits; a whole-set write moves everyone's.
    assert _put(env, "admin", "acme", TIGHTER).status_code == 201
    assert _put(other, "acme", "acme", ADMIN_LIMITS).status_code == 403
    current = env.call("admin", "GET", "/v1/policies/current").json()["policy"]
    current["tenants"]["acme"] = ADMIN_LIMITS
    whole = env.call("admin", "PUT", "/v1/policies", json={"policy": current, "reason": "r"})
    assert whole.status_code == 201, whole.text
    assert _put(other, "acme", "acme", ADMIN_LIMITS).status_code == 201
    assert _put(env, "acme", "acme", {**ADMIN_LIMITS, "audit": "minimal"}).status_code == 403


@contextmanager
def _second_process(env: ApiEnv) -> Iterator[ApiEnv]:
    """Services opened afresh on `env`'s database and settings, as another worker process."""
    services = Services.open(env.services.config)
    client = TestClient(create_app(services))
    try:
        yield ApiEnv(client, services, keys=env.keys, signing_key=env.signing_key)
    finally:
        client.close()
        services.close()


def test_versions_stored_before_limits_of_are_read_by_their_author_role(
    make_env: Callable[..., ApiEnv],
) -> None:
    """A version stored before the column (NULL `limits_of`) by an admin set every tenant's
    limits, as it did then; one by a tenant_admin set none."""
    env = make_env()
    assert _put(env, "admin", "acme", ADMIN_LIMITS).status_code == 201
    assert _put(env, "acme", "acme", TIGHTER).status_code == 201
    with env.services.db.begin() as conn:  # as 0.2 stored them: no limits_of
        for version, role in ((3, "admin"), (4, "tenant_admin")):
            conn.execute(
                sa.text(
                    "INSERT INTO policy_versions (version, created_at, author, reason, digest,"
                    " document, author_role) SELECT :v, created_at, author, reason, digest,"
                    " document, :role FROM policy_versions WHERE version = 2"
                ),
                {"v": version, "role": role},
            )
        conn.execute(sa.text("UPDATE policy_head SET version = 3"))
        conn.execute(sa.text("UPDATE policy_head SET version = 4"))
    env.services.publisher.forget()
    # Version 3 (a legacy admin version holding acme's tightened entry) is acme's limit now.
    assert _put(env, "acme", "acme", ADMIN_LIMITS).status_code == 403
    assert _put(env, "acme", "acme", TIGHTER).status_code == 201


def _limits_of(env: ApiEnv) -> list[str | None]:
    with env.services.db.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT limits_of FROM policy_versions ORDER BY version")
            ).scalars()
        )


# --- one transaction: state, commands, ledger events ----------------------------------------------


def test_a_write_that_fails_midway_leaves_nothing(
    make_env: Callable[..., ApiEnv], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine command fails after the tenant row and the policy version were written in the
    same transaction: neither remains, and no event waits in the outbox."""
    env = make_env()
    services = env.services

    def broken(*_a: Any, **_k: Any) -> int:
        raise sa.exc.OperationalError("INSERT", {}, Exception("connection lost"))

    monkeypatch.setattr(services.commands, "submit_purge", broken)
    r = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "x"})
    assert r.status_code >= 500
    assert services.tenants.get("acme").enabled
    assert services.policies.current() is None
    with services.db.connect() as conn:
        pending = conn.execute(
            sa.select(OutboxRow.event).where(OutboxRow.ledger_index.is_(None))
        ).all()
    assert pending == []
    actions = [e["details"] for e in _entries(env, EventKind.ADMIN_ACTION.value)]
    assert actions[-1]["action"] == "tenant.disable" and actions[-1]["outcome"] == "failed"


def test_a_ledger_outage_after_commit_delays_the_entries_but_never_loses_them(
    make_env: Callable[..., ApiEnv], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_env()
    services = env.services
    real_append = services.ledger.store.append_collected  # every append goes through it
    monkeypatch.setattr(services.ledger.store, "append_collected", _ledger_down)
    r = env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "initech"})
    assert r.status_code == 201  # the tenant and its entry committed together
    assert services.outbox.pending() == 1
    monkeypatch.setattr(services.ledger.store, "append_collected", real_append)
    assert services.deliver()
    assert services.outbox.pending() == 0
    created = [
        e["details"]
        for e in _entries(env, EventKind.ADMIN_ACTION.value)
        if e["details"]["action"] == "tenant.create"
    ]
    assert created[-1]["outcome"] == "ok"


def test_concurrent_drains_deliver_every_event_exactly_once(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db, outbox_drain_s=None)
    services = env.services
    with services.db.connect() as conn:
        before = conn.execute(sa.select(sa.func.count()).select_from(OutboxRow)).scalar_one()
    size_before = services.ledger.size
    event = services.actions.event(
        services.keys.authenticate(env.keys["admin"]),  # type: ignore[arg-type]
        "test.event",
        "ok",
    )
    with services.write() as conn:
        services.outbox.add(conn, [event] * 1200)
    threads = [threading.Thread(target=services.actions.deliver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    services.actions.deliver()
    with services.db.connect() as conn:
        rows = conn.execute(sa.select(OutboxRow.ledger_index)).scalars().all()
    indices = [i for i in rows if i is not None]
    assert len(rows) == before + 1200 and len(indices) == len(rows)
    assert len(set(indices)) == len(indices)
    assert services.ledger.size == size_before + 1200 + 0  # each event appended once
    assert services.ledger.verify().size == services.ledger.size


def test_outbox_rows_hold_no_tenant_id_outside_the_payload(make_env: Callable[..., ApiEnv]) -> None:
    env = make_env()
    env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "initech"})
    with env.services.db.connect() as conn:
        events = [json.loads(e) for e in conn.execute(sa.select(OutboxRow.event)).scalars()]
        assert conn.execute(sa.select(TenantRow.tenant_id)).scalars().all()
    for event in events:
        without_payload = {k: v for k, v in event.items() if k != "payload"}
        assert "initech" not in json.dumps(without_payload)


def test_no_certificate_until_the_request_entry_is_in_the_ledger(
    make_env: Callable[..., ApiEnv], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge committed while the ledger was down runs on the engines (its command committed with
    its outbox entry), but the job is `done`, and certified, only once that entry is delivered."""
    env = make_env(outbox_drain_s=None)
    services = env.services
    engine = SimEngine(services, "engine-one")
    engine.cache(scope("acme"), [0, 1])
    real_append = services.ledger.store.append_collected  # every append goes through it
    monkeypatch.setattr(services.ledger.store, "append_collected", _ledger_down)
    r = env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    monkeypatch.setattr(
        services.ledger.store, "append_collected", _append_except_outbox(real_append)
    )
    engine.run_commands()
    engine.zeroize()
    job = env.call("admin", "GET", f"/v1/purges/{job_id}").json()
    assert job["status"] == "running" and job["blocks_cleared"] == 2
    assert env.call("admin", "GET", f"/v1/purges/{job_id}/certificate").status_code == 409
    monkeypatch.setattr(services.ledger.store, "append_collected", real_append)
    assert services.deliver()
    job = env.call("admin", "GET", f"/v1/purges/{job_id}").json()
    assert job["status"] == "done"
    cert = env.call("admin", "GET", f"/v1/purges/{job_id}/certificate")
    assert cert.status_code == 200
    assert "request" in [e["role"] for e in cert.json()["evidence"]["entries"]]


def _ledger_down(*_a: Any, **_k: Any) -> tuple[int, int]:
    raise LedgerUnavailableError("ledger down")


def _append_except_outbox(real: Callable[..., tuple[int, int]]) -> Callable[..., tuple[int, int]]:
    """The engine's entries go through; the API's outbox drain (its `Claim`, which is not a
    plain collect function) still fails."""

    def append_collected(collect: Any, after: Any = None) -> tuple[int, int]:
        if not callable(collect):
            raise LedgerUnavailableError("ledger down for the API")
        return real(collect, after)

    return append_collected


def test_a_write_transaction_never_takes_a_second_connection(
    make_env: Callable[..., ApiEnv],
) -> None:
    """Inside `services.write()` everything uses the transaction's connection: a second pooled one
    could wait forever on the row locks the first holds once every pooled connection waits on them
    (0.1.x's purge route read the engine registry that way and deadlocked under load)."""
    services = make_env().services
    with pytest.raises(RuntimeError, match="second database connection"), services.write():
        services.engines.engines()
    assert services.engines.engines() == []  # outside a write: fine


def test_the_deliverer_groups_concurrent_writers_into_few_drains() -> None:
    """Every caller waits for a drain that started after its call (so its own committed rows are
    in it); callers arriving during a drain share the next one."""
    from kvguard.control.outbox import Deliverer  # noqa: PLC0415

    passes: list[float] = []
    calls: list[float] = []
    lock = threading.Lock()

    def drain() -> None:
        passes.append(time.monotonic())
        time.sleep(0.05)  # a ledger transaction

    deliverer = Deliverer(drain, interval_s=None)
    results: list[bool] = []

    def writer() -> None:
        with lock:
            calls.append(time.monotonic())
        results.append(deliverer.deliver())

    threads = [threading.Thread(target=writer) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    deliverer.close()
    assert results == [True] * 40
    assert len(passes) < 20  # grouped, not one drain per writer
    assert max(passes) >= max(calls)  # the last caller was served by a drain started after it

    failing = Deliverer(lambda: 1 / 0, interval_s=None)
    assert failing.deliver() is False  # reported, not raised: the rows stay pending
    failing.close()
