"""Review of the admin API's contract with the control tables under concurrency and outages
(adversarial review, 2026-11-28). Each test failed on the code before its fix.

1. An inference key can be issued for a tenant that a concurrent disable has just disabled:
   `TenantKeys.issue` reads the tenant row without a lock (READ COMMITTED), so a disable that has
   updated the row but not yet committed does not stop it, and the key commits after the disable
   (docs/api.md: "disabled tenant 409"; docs/operations.md: keys "only for registered, enabled
   tenants"). Seen under load: 18 keys created after `disabled_at` in 8 disable races.
2. `/readyz` answers a database outage with `503` but without `Retry-After` and without the one
   error body (docs/api.md, "Errors": 503 `unavailable` ... `Retry-After: 5`), unlike every other
   route in the same outage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from tests.api.conftest import ApiEnv
from tests.api.test_hardening import _database_down

MakeEnv = Callable[..., ApiEnv]


def _if_match(env: ApiEnv) -> dict[str, str]:
    """The current version as `If-Match`: what a deliberate re-enable sends."""
    return {"If-Match": env.call("admin", "GET", "/v1/policies/current").headers["ETag"]}


@pytest.mark.postgres
def test_inference_key_is_not_issued_across_a_concurrent_disable(
    make_env: MakeEnv, pg_db: str
) -> None:
    env = make_env(pg_db)
    other = sa.create_engine(pg_db)
    try:
        with other.connect() as conn:
            tx = conn.begin()
            # What `POST /v1/tenants/acme/disable` does first, in its own transaction: the row is
            # updated and the transaction has not committed yet (it goes on to store the policy
            # version and queue the purge).
            conn.execute(
                sa.text(
                    "UPDATE tenants SET disabled_at = :now, disabled_by = 'key:review',"
                    " disable_reason = 'r' WHERE tenant_id = 'acme' AND disabled_at IS NULL"
                ),
                {"now": time.time()},
            )
            answer: dict[str, Any] = {}

            def issue() -> None:
                r = env.call("acme", "POST", "/v1/tenants/acme/inference-keys")
                answer["status"] = r.status_code

            thread = threading.Thread(target=issue)
            thread.start()
            thread.join(1.0)  # an issue that waits for the disable's row lock is still running
            tx.commit()  # the disable commits
            thread.join(30)
        with other.connect() as conn:
            disabled_at = conn.execute(
                sa.text("SELECT disabled_at FROM tenants WHERE tenant_id = 'acme'")
            ).scalar_one()
            late = conn.execute(
                sa.text(
                    "SELECT count(*) FROM tenant_api_keys WHERE tenant_id = 'acme'"
                    " AND NOT revoked AND created_at >= :at"
                ),
                {"at": disabled_at},
            ).scalar_one()
    finally:
        other.dispose()
    assert disabled_at is not None
    assert answer.get("status") == 409, answer
    assert late == 0, "an inference key was issued for a tenant after it was disabled"


@pytest.mark.postgres
def test_readyz_outage_answer_carries_retry_after(make_env: MakeEnv, pg_db: str) -> None:
    env = make_env(pg_db)
    with _database_down(pg_db):
        other = env.call("admin", "GET", "/v1/tenants/acme")
        ready = env.client.get("/readyz")
    assert other.status_code == 503 and int(other.headers["retry-after"]) >= 1  # the contract
    assert ready.status_code == 503
    assert "retry-after" in ready.headers, "/readyz 503 without Retry-After"
    assert int(ready.headers["retry-after"]) >= 1


def test_a_whole_set_put_keeps_a_disabled_tenant_disabled_unless_it_says_enabled(
    env: ApiEnv,
) -> None:
    """An entry for the disabled tenant without `enabled` keeps it disabled; an explicit
    `"enabled": true` re-enables it and ends the registry's disable (it can be disabled again)."""
    assert (
        env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "x"}).status_code
        == 200
    )

    def put(entry: dict[str, Any]) -> bool:
        r = env.call(
            "admin", "PUT", "/v1/policies",
            json={"policy": {"tenants": {"acme": entry}}, "reason": "routine"},
            headers=_if_match(env),  # a re-enable names the version it edits (428 otherwise)
        )  # fmt: skip
        assert r.status_code == 201, r.text
        return bool(env.call("admin", "GET", "/v1/tenants/acme/policy").json()["policy"]["enabled"])

    assert put({"reuse": "tenant"}) is False
    assert env.call("admin", "GET", "/v1/tenants/acme").json()["enabled"] is False
    assert put({"reuse": "tenant", "enabled": True}) is True
    assert env.call("admin", "GET", "/v1/tenants/acme").json()["enabled"] is True
    again = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "again"})
    assert again.status_code == 200, again.text


def test_a_disabled_tenant_stays_disabled_while_the_default_is_switched_off_and_on(
    env: ApiEnv,
) -> None:
    """A whole-set PUT whose default disables everyone, then one whose default enables everyone,
    neither naming the tenant: the first dropped the tenant's `enabled: false` entry (the default
    covered it), so the second re-enabled it silently while the registry said disabled and its
    next disable was refused 409 (found by a review). Then an explicit re-enable through the
    tenant's own entry ends the registry's disable."""
    assert (
        env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "x"}).status_code
        == 200
    )

    def put_default(enabled: bool) -> None:
        r = env.call(
            "admin", "PUT", "/v1/policies",
            json={"policy": {"default": {"enabled": enabled}}, "reason": "routine"},
            headers=_if_match(env),
        )  # fmt: skip
        assert r.status_code == 201, r.text

    def acme() -> tuple[bool, bool]:
        policy = env.call("admin", "GET", "/v1/tenants/acme/policy").json()["policy"]
        return bool(policy["enabled"]), bool(
            env.call("admin", "GET", "/v1/tenants/acme").json()["enabled"]
        )

    put_default(False)
    put_default(True)
    assert acme() == (False, False)
    r = env.call(
        "admin", "PUT", "/v1/tenants/acme/policy",
        json={"policy": {"enabled": True}, "reason": "back"},
        headers=_if_match(env),
    )  # fmt: skip
    assert r.status_code == 201, r.text
    assert acme() == (True, True)
    again = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "again"})
    assert again.status_code == 200, again.text


def test_a_tenant_put_without_enabled_keeps_a_disabled_tenant_disabled(env: ApiEnv) -> None:
    """docs/api.md: only an entry that says `"enabled": true` re-enables. `TenantPolicy.enabled`
    defaults to true, so an admin's `PUT /v1/tenants/{id}/policy` that left it out re-enabled the
    tenant (and ended its registry disable; found by a review)."""
    assert (
        env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "x"}).status_code
        == 200
    )
    r = env.call(
        "admin", "PUT", "/v1/tenants/acme/policy",
        json={"policy": {"reuse": "tenant"}, "reason": "edit"},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    assert env.call("admin", "GET", "/v1/tenants/acme/policy").json()["policy"]["enabled"] is False
    assert env.call("admin", "GET", "/v1/tenants/acme").json()["enabled"] is False


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_document_read_before_a_disable_does_not_re_enable_the_tenant(
    make_env: MakeEnv, tmp_path: Any, request: pytest.FixtureRequest, db: str
) -> None:
    """Admin A reads the policy set (`GET` prints every entry with `"enabled": true`), admin B
    disables acme, A edits another tenant in that document and writes it back: the write silently
    re-enabled acme, in the policy and in the registry (found by a review). A re-enable must name
    the version it edits: without `If-Match` it is 428 and nothing is stored; with the stale
    version it is 412."""
    url = f"sqlite:///{tmp_path / 'r.db'}" if db == "sqlite" else request.getfixturevalue("pg_db")
    env = make_env(url)
    r = env.call(
        "admin", "PUT", "/v1/tenants/acme/policy",
        json={"policy": {"retention": {"ttl_s": 60, "idle_s": 30}}, "reason": "x"},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    got = env.call("admin", "GET", "/v1/policies/current")
    doc, etag = got.json()["policy"], got.headers["ETag"]
    disabled = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "breach"})
    assert disabled.status_code == 200, disabled.text
    doc["tenants"]["globex"] = {"reuse": "none"}
    body = {"policy": doc, "reason": "edit globex"}
    blind = env.call("admin", "PUT", "/v1/policies", json=body)
    assert blind.status_code == 428, blind.text
    assert blind.json()["error"] == "precondition_required" and "acme" in blind.json()["message"]
    stale = env.call("admin", "PUT", "/v1/policies", json=body, headers={"If-Match": etag})
    assert stale.status_code == 412, stale.text
    current = env.services.policies.current()
    assert current is not None and current.policy.policy_for("acme").enabled is False
    assert env.services.tenants.get("acme").enabled is False


def _wait_for_lock_waiters(engine: sa.Engine, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.connect() as c:
            waiting = c.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"
                )
            ).scalar_one()
        if waiting >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} sessions waiting on a lock")


@pytest.mark.postgres
def test_a_disable_and_a_concurrent_policy_put_do_not_deadlock(
    make_env: MakeEnv, pg_db: str
) -> None:
    """The disable took the tenant's row, then `command_head` (its purge), then `policy_head`;
    every policy write takes `policy_head` first, then `command_head`. With `command_head` held
    by a third session, the disable and a PUT each took their first lock and then waited for each
    other: PostgreSQL broke the deadlock after `deadlock_timeout` and one of them answered 503
    (found by a review). Now the disable takes `policy_head` first as well."""
    env = make_env(pg_db)
    other = sa.create_engine(pg_db)
    answers: dict[str, Any] = {}
    try:
        with other.connect() as conn:
            tx = conn.begin()
            conn.execute(sa.text("UPDATE command_head SET seq = seq WHERE id = 1"))

            def disable() -> None:
                r = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "r"})
                answers["disable"] = (r.status_code, r.text[:300])

            def put() -> None:
                r = env.call(
                    "admin", "PUT", "/v1/tenants/globex/policy",
                    json={"policy": {"reuse": "tenant"}, "reason": "edit"},
                )  # fmt: skip
                answers["put"] = (r.status_code, r.text[:300])

            a = threading.Thread(target=disable)
            a.start()
            _wait_for_lock_waiters(
                other, 1
            )  # the disable waits (for command_head, or now the head)
            b = threading.Thread(target=put)
            b.start()
            time.sleep(0.5)  # the PUT reaches its first lock
            tx.commit()
            a.join(30)
            b.join(30)
    finally:
        other.dispose()
    assert answers["disable"][0] == 200, answers
    assert answers["put"][0] == 201, answers
    current = env.services.policies.current()
    assert current is not None and current.policy.policy_for("acme").enabled is False
    assert env.services.tenants.get("acme").enabled is False
