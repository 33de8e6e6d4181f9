"""Tenants and policies through the API, on SQLite and PostgreSQL; every change is in the ledger."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from kvguard.audit.events import EventKind
from tests.api.conftest import ApiEnv


def _actions(env: ApiEnv) -> list[dict[str, object]]:
    page = env.services.ledger.query(kinds=[EventKind.ADMIN_ACTION], limit=1000)
    return [dict(r.event.details) for r in page.records]


def test_create_list_get_tenants(make_env: Callable[..., ApiEnv], any_db: str) -> None:
    env = make_env(any_db)
    r = env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "initech", "display_name": "I"})
    assert r.status_code == 201, r.text
    assert r.json()["enabled"] is True and r.json()["created_by"].startswith("key:")
    assert (
        env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "initech"}).status_code == 409
    )
    ids = [t["tenant_id"] for t in env.call("auditor", "GET", "/v1/tenants").json()["tenants"]]
    assert ids == ["acme", "globex", "initech"]
    page = env.call("admin", "GET", "/v1/tenants", params={"limit": 2}).json()
    assert [t["tenant_id"] for t in page["tenants"]] == ["acme", "globex"]
    assert page["next_after"] == "globex"
    # A tenant_admin sees exactly its own tenant.
    own = env.call("acme", "GET", "/v1/tenants").json()["tenants"]
    assert [t["tenant_id"] for t in own] == ["acme"]
    assert env.call("acme", "GET", "/v1/tenants/globex").status_code == 404
    assert env.call("acme", "GET", "/v1/tenants/acme").json()["display_name"] == "Acme"
    outcomes = [(a["action"], a["outcome"]) for a in _actions(env)]
    assert outcomes == [("tenant.create", "ok"), ("tenant.create", "conflict")]


def test_bad_tenant_ids_are_refused_naming_the_field(env: ApiEnv) -> None:
    for bad in ("", "a/b", "x" * 129, " space", "-lead"):
        r = env.call("admin", "POST", "/v1/tenants", json={"tenant_id": bad})
        assert r.status_code == 422, bad
        assert "body.tenant_id" in r.json()["message"]
    r = env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "ok", "extra": 1})
    assert r.status_code == 422 and "body.extra" in r.json()["message"]


def test_policy_put_history_diff_and_ledger(make_env: Callable[..., ApiEnv], any_db: str) -> None:
    env = make_env(any_db)
    current = env.call("auditor", "GET", "/v1/policies/current").json()
    assert current["change"] is None  # built-in defaults
    policy = current["policy"]
    policy["tenants"] = {"acme": {"retention": {"ttl_s": 60, "idle_s": 30}}}
    r = env.call("admin", "PUT", "/v1/policies", json={"policy": policy, "reason": "shorter TTL"})
    assert r.status_code == 201, r.text
    assert r.json()["version"] == 1 and r.json()["reason"] == "shorter TTL"
    history = env.call("auditor", "GET", "/v1/policies/history").json()
    assert [h["version"] for h in history] == [1]
    diff = env.call(
        "auditor", "GET", "/v1/policies/diff", params={"from_version": 0, "to_version": 1}
    ).json()
    paths = {c["path"]: (c["old"], c["new"]) for c in diff["changes"]}
    assert paths["tenants.acme.retention.ttl_s"] == (3600, 60)  # the default's, then acme's
    assert env.call("auditor", "GET", "/v1/policies/versions/7").status_code == 404
    kinds = [r.event.kind for r in env.services.ledger.query(limit=100).records]
    assert kinds == [EventKind.POLICY_CHANGE, EventKind.ADMIN_ACTION]
    # Engines are told: the command queue holds a policy command for version 1.
    assert any(getattr(c, "version", None) == 1 for c in env.services.commands.pending_after(0))


def test_policy_diff_lists_only_changes(env: ApiEnv) -> None:
    """From version 0 (the defaults, also an empty store) the diff listed no-op entries: a new
    tenant's null fields as `null -> null` and the emptied-out `tenants: {}` as `{} -> null`."""

    def diff(a: int, b: int) -> list[dict[str, Any]]:
        params = {"from_version": a, "to_version": b}
        r = env.call("auditor", "GET", "/v1/policies/diff", params=params)
        assert r.status_code == 200, r.text
        changes: list[dict[str, Any]] = r.json()["changes"]
        return changes

    assert diff(0, 0) == []
    policy = env.call("auditor", "GET", "/v1/policies/current").json()["policy"]
    policy["tenants"] = {"acme": {"retention": {"ttl_s": 60, "idle_s": 30}}}
    r = env.call("admin", "PUT", "/v1/policies", json={"policy": policy, "reason": "acme"})
    assert r.status_code == 201, r.text
    for a, b in ((0, 1), (1, 0)):
        changes = diff(a, b)
        assert changes and all(c["old"] != c["new"] for c in changes), changes
        paths = [c["path"] for c in changes]
        assert "tenants" not in paths and "tenants.acme.quota.max_blocks" not in paths
        assert "tenants.acme.retention.ttl_s" in paths
    assert diff(1, 1) == []
    policy["epoch"] = 1
    policy["tenants"]["acme"]["quota"] = {"max_blocks": 1}
    r = env.call("admin", "PUT", "/v1/policies", json={"policy": policy, "reason": "epoch"})
    assert r.status_code == 201, r.text
    assert {c["path"]: (c["old"], c["new"]) for c in diff(1, 2)} == {
        "epoch": (0, 1),
        "tenants.acme.quota.max_blocks": (None, 1),
    }


def test_policy_diff_compares_a_newly_named_tenant_against_the_default(env: ApiEnv) -> None:
    """A tenant only one version names read as null in the other, but it had that version's
    default policy there: naming acme with `max_blocks: null` under a default cap of 100 lifted
    acme's cap, and the diff did not list it. A tenant named with exactly the default showed
    nothing at all; its naming is now listed as `tenants.<id>`."""

    def diff(a: int, b: int) -> dict[str, tuple[Any, Any]]:
        params = {"from_version": a, "to_version": b}
        r = env.call("auditor", "GET", "/v1/policies/diff", params=params)
        assert r.status_code == 200, r.text
        return {c["path"]: (c["old"], c["new"]) for c in r.json()["changes"]}

    def put(policy: dict[str, Any], reason: str) -> None:
        r = env.call("admin", "PUT", "/v1/policies", json={"policy": policy, "reason": reason})
        assert r.status_code == 201, r.text

    assert diff(0, 0) == {}
    policy = env.call("auditor", "GET", "/v1/policies/current").json()["policy"]
    policy["default"]["quota"]["max_blocks"] = 100
    put(policy, "cap everyone")  # version 1
    policy["tenants"] = {"acme": {"quota": {"max_blocks": None}}}
    put(policy, "lift acme's cap")  # version 2
    acme = env.call("auditor", "GET", "/v1/policies/versions/2").json()["policy"]["tenants"]["acme"]
    assert diff(1, 2) == {
        "tenants.acme": (None, acme),
        "tenants.acme.quota.max_blocks": (100, None),
    }
    assert diff(2, 1) == {
        "tenants.acme": (acme, None),
        "tenants.acme.quota.max_blocks": (None, 100),
    }
    # Named with exactly the default: no field differs, yet the naming is never invisible.
    policy["tenants"]["globex"] = {"quota": {"max_blocks": 100}}
    put(policy, "name globex")  # version 3
    globex = env.call("auditor", "GET", "/v1/policies/versions/3").json()["policy"]["tenants"]
    assert diff(2, 3) == {"tenants.globex": (None, globex["globex"])}
    assert diff(3, 2) == {"tenants.globex": (globex["globex"], None)}
    assert diff(3, 3) == {}


def test_invalid_policy_is_refused_with_the_field_path(env: ApiEnv) -> None:
    bad = {"tenants": {"acme": {"retention": {"ttl_s": -5}}}}
    r = env.call("admin", "PUT", "/v1/policies", json={"policy": bad, "reason": "x"})
    assert r.status_code == 422
    assert "body.policy.tenants.acme.retention.ttl_s" in r.json()["message"]
    typo = {"tenants": {"acme": {"retention": {"ttl": 0}}}}
    r = env.call("admin", "PUT", "/v1/policies", json={"policy": typo, "reason": "x"})
    assert r.status_code == 422 and "retention.ttl" in r.json()["message"]
    assert env.services.policies.current() is None


def test_tenant_admin_changes_its_own_policy_but_not_enabled_or_groups(env: ApiEnv) -> None:
    got = env.call("acme", "GET", "/v1/tenants/acme/policy").json()
    assert got["explicit"] is False and got["version"] == 0
    policy = got["policy"]
    policy["retention"] = {"ttl_s": 120, "idle_s": 60}
    r = env.call("acme", "PUT", "/v1/tenants/acme/policy", json={"policy": policy, "reason": "r"})
    assert r.status_code == 201, r.text
    stored = env.services.policies.current()
    assert stored is not None and stored.policy.tenants["acme"].retention.ttl_s == 120
    assert "globex" not in stored.policy.tenants
    policy["enabled"] = False
    r = env.call("acme", "PUT", "/v1/tenants/acme/policy", json={"policy": policy, "reason": "r"})
    assert r.status_code == 403
    r = env.call("acme", "PUT", "/v1/tenants/globex/policy", json={"policy": policy, "reason": "r"})
    assert r.status_code == 404
    assert env.call("acme", "GET", "/v1/policies/current").status_code == 403
    outcomes = [(a["action"], a["outcome"]) for a in _actions(env)]
    assert outcomes == [
        ("tenant.policy.put", "ok"),
        ("tenant.policy.put", "denied"),
        ("tenant.policy.put", "not_found"),
    ]


def test_disable_tenant_stores_a_policy_and_queues_a_purge(env: ApiEnv) -> None:
    r = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "contract ended"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (
        body["tenant"]["enabled"] is False and body["tenant"]["disable_reason"] == "contract ended"
    )
    stored = env.services.policies.get(body["policy_version"])
    assert stored.policy.tenants["acme"].enabled is False
    commands = env.services.commands.pending_after(0)
    assert any(getattr(c, "id", None) == body["purge_job_id"] for c in commands)
    again = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "again"})
    assert again.status_code == 409
    assert (
        env.call("admin", "POST", "/v1/tenants/nope/disable", json={"reason": "x"}).status_code
        == 404
    )
    assert (
        env.call("acme", "POST", "/v1/tenants/acme/disable", json={"reason": "x"}).status_code
        == 403
    )


def test_admin_action_entries_name_the_tenant_only_by_tag(env: ApiEnv) -> None:
    env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "initech"})
    record = env.services.ledger.query(kinds=[EventKind.ADMIN_ACTION], limit=10).records[0]
    assert b"initech" not in record.leaf
    assert record.event.scope_tag == env.services.deriver.tenant_tag("initech")
    assert record.event.payload == {"tenant_id": "initech"}


def test_inference_keys_create_list_revoke_and_scoping(env) -> None:
    from kvguard.audit.events import EventKind  # noqa: PLC0415

    created = env.call("acme", "POST", "/v1/tenants/acme/inference-keys")
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["api_key"].startswith("kvg_") and body["tenant_id"] == "acme"
    assert env.services.inference_keys.tenant_for(body["api_key"]) == "acme"
    listed = env.call("auditor", "GET", "/v1/tenants/acme/inference-keys").json()["keys"]
    assert [k["key_id"] for k in listed] == [body["key_id"]]
    assert body["api_key"] not in str(listed)
    # globex's tenant_admin cannot see or revoke acme's key (404, as for a missing tenant).
    url = f"/v1/tenants/acme/inference-keys/{body['key_id']}/revoke"
    assert env.call("globex", "POST", url).status_code == 404
    # ... nor reach it through its own tenant's path.
    own = f"/v1/tenants/globex/inference-keys/{body['key_id']}/revoke"
    assert env.call("globex", "POST", own).status_code == 404
    revoked = env.call("acme", "POST", url)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert env.services.inference_keys.tenant_for(body["api_key"]) is None  # next request: 401
    again = env.call("acme", "POST", url)  # idempotent, and recorded as a repeat
    assert again.status_code == 200 and again.json()["revoked"] is True
    assert env.call("admin", "POST", "/v1/tenants/nobody/inference-keys").status_code == 404
    env.call("admin", "POST", "/v1/tenants/globex/disable", json={"reason": "test"})
    assert env.call("admin", "POST", "/v1/tenants/globex/inference-keys").status_code == 409
    env.services.ledger.flush()
    page = env.services.ledger.query(kinds=[EventKind.ADMIN_ACTION.value], limit=100)
    actions = [(r.event.details["action"], r.event.details["outcome"]) for r in page.records]
    assert ("inference_key.create", "ok") in actions
    assert ("inference_key.revoke", "ok") in actions
    revokes = [
        d
        for d in (r.event.details for r in page.records)
        if d["action"] == "inference_key.revoke" and d["outcome"] == "ok"
    ]
    assert [d.get("already_revoked") for d in revokes] == [None, True]
    assert body["api_key"] not in str([r.leaf for r in page.records])


def test_inference_key_listing_pages_newest_first_without_gaps(
    make_env, any_db: str, monkeypatch
) -> None:
    """A tenant's keys come a page at a time (`after`, `limit`), newest first, each exactly once,
    also when keys share a creation time; a cursor that is not one of the tenant's keys is 404."""
    import kvguard.control.keys as keys_module  # noqa: PLC0415

    env = make_env(any_db)

    issued = [env.call("acme", "POST", "/v1/tenants/acme/inference-keys").json() for _ in range(3)]
    monkeypatch.setattr(keys_module.time, "time", lambda: 4_000_000_000.0)  # ties, newest of all
    issued += [
        env.call("admin", "POST", "/v1/tenants/acme/inference-keys").json() for _ in range(4)
    ]
    monkeypatch.undo()
    other = env.call("admin", "POST", "/v1/tenants/globex/inference-keys").json()
    base = "/v1/tenants/acme/inference-keys"
    whole = env.call("auditor", "GET", base).json()
    assert whole["next_after"] is None and len(whole["keys"]) == 7
    seen: list[dict] = []
    after = None
    while True:
        url = f"{base}?limit=2" + (f"&after={after}" if after else "")
        page = env.call("acme", "GET", url)
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["keys"]) <= 2
        seen += body["keys"]
        after = body["next_after"]
        if after is None:
            break
    assert seen == whole["keys"]  # same order, nothing twice, nothing missing
    assert sorted(k["key_id"] for k in seen) == sorted(k["key_id"] for k in issued)
    created = [k["created_at"] for k in seen]
    assert created == sorted(created, reverse=True)
    assert {k["key_id"] for k in seen[:4]} == {k["key_id"] for k in issued[3:]}  # the tied ones
    # Another tenant's key or an unknown one as the cursor: 404, the id not echoed.
    for cursor in (other["key_id"], "0123456789ab"):
        missing = env.call("acme", "GET", f"{base}?after={cursor}")
        assert missing.status_code == 404 and cursor not in missing.text
    assert env.call("acme", "GET", f"{base}?after=XYZ").status_code == 422
    assert env.call("acme", "GET", f"{base}?limit=0").status_code == 422
    assert env.call("acme", "GET", f"{base}?limit=1001").status_code == 422


def test_tenant_policy_put_reads_the_tenant_only_until_it_is_known(env: ApiEnv) -> None:
    """The existence check of a tenant policy PUT (and of a tenant policy read) reads the tenant
    row until it has been found once; a tenant_admin's PUT for another, registered tenant stays
    404 when this process knows that tenant, and an unknown tenant stays 404 with its entry."""
    sent: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        sent.append(statement)

    def tenant_reads() -> int:
        return sum(s.lstrip().upper().startswith("SELECT") and "FROM tenants" in s for s in sent)

    body = {"policy": {"retention": {"ttl_s": 120, "idle_s": 60}}, "reason": "r"}
    sa.event.listen(env.services.db, "before_cursor_execute", seen)
    try:
        assert env.call("admin", "PUT", "/v1/tenants/globex/policy", json=body).status_code == 201
        assert tenant_reads() == 1
        assert env.call("admin", "PUT", "/v1/tenants/globex/policy", json=body).status_code == 201
        assert env.call("admin", "GET", "/v1/tenants/globex/policy").status_code == 200
        assert tenant_reads() == 1
        r = env.call("acme", "PUT", "/v1/tenants/globex/policy", json=body)
        assert r.status_code == 404, r.text
        assert env.call("acme", "GET", "/v1/tenants/globex/policy").status_code == 404
        for _ in range(2):
            r = env.call("admin", "PUT", "/v1/tenants/nobody/policy", json=body)
            assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
        assert tenant_reads() == 3
    finally:
        sa.event.remove(env.services.db, "before_cursor_execute", seen)
    stored = env.services.policies.current()
    assert stored is not None and stored.change.version == 2
    outcomes = [(a["action"], a["outcome"]) for a in _actions(env)]
    assert outcomes == [
        ("tenant.policy.put", "ok"),
        ("tenant.policy.put", "ok"),
        ("tenant.policy.put", "not_found"),
        ("tenant.policy.put", "not_found"),
        ("tenant.policy.put", "not_found"),
    ]


def test_policy_history_comes_a_page_at_a_time(env: ApiEnv) -> None:
    """`GET /v1/policies/history`: oldest first, at most `limit` (1-1000) versions after `after`."""
    for n in range(1, 6):
        body = {"policy": {"tenants": {"acme": {"audit": "full"}}}, "reason": f"change {n}"}
        assert env.call("admin", "PUT", "/v1/policies", json=body).status_code == 201
    pages = [
        env.call("auditor", "GET", "/v1/policies/history", params={"after": a, "limit": 2}).json()
        for a in (0, 2, 4, 5)
    ]
    assert [[h["version"] for h in page] for page in pages] == [[1, 2], [3, 4], [5], []]
    everything = env.call("auditor", "GET", "/v1/policies/history").json()
    assert [h["version"] for h in everything] == [1, 2, 3, 4, 5]
    for bad in ({"limit": 1001}, {"limit": 0}, {"after": -1}):
        r = env.call("auditor", "GET", "/v1/policies/history", params=bad)
        assert r.status_code == 422, (bad, r.text)
