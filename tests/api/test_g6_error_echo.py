"""G6: a 422 body names the field, never echoes the value sent (kvguard.api.errors docstring).
An API key sent by mistake in a policy field or as a JSON member name must not come back (found by
a review: both were echoed)."""

from __future__ import annotations

from tests.api.conftest import ApiEnv


def test_duplicate_group_value_is_not_echoed(env: ApiEnv) -> None:
    secret = env.keys["auditor"]
    policy = env.call("admin", "GET", "/v1/policies/current").json()["policy"]
    policy["default"]["groups"] = [secret, secret]
    r = env.call("admin", "PUT", "/v1/policies", json={"policy": policy, "reason": "r"})
    assert r.status_code == 422
    assert secret not in r.text


def test_unknown_member_name_is_not_echoed(env: ApiEnv) -> None:
    secret = env.keys["auditor"]
    r = env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "zz", secret: 1})
    assert r.status_code == 422
    assert secret not in r.text


def test_a_conflict_does_not_echo_the_tenant_id(env: ApiEnv) -> None:
    """409s named the tenant id sent ("tenant '...' already exists"); an id is the caller's input
    and may be a key pasted in the wrong place."""
    secret = env.keys["auditor"].replace("-", "_")[:120]
    created = env.call("admin", "POST", "/v1/tenants", json={"tenant_id": secret})
    if created.status_code == 422:  # the id pattern refuses it: nothing to echo either
        assert secret not in created.text
        return
    assert created.status_code == 201, created.text
    again = env.call("admin", "POST", "/v1/tenants", json={"tenant_id": secret})
    assert again.status_code == 409 and secret not in again.text
    path = f"/v1/tenants/{secret}/disable"
    assert env.call("admin", "POST", path, json={"reason": "r"}).status_code == 200
    twice = env.call("admin", "POST", path, json={"reason": "r"})
    assert twice.status_code == 409 and secret not in twice.text
    keys = env.call("admin", "POST", f"/v1/tenants/{secret}/inference-keys")
    assert keys.status_code == 409 and secret not in keys.text
