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
