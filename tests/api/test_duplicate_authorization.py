"""Two `Authorization` headers are refused (401), never resolved by picking one: the request gate
read the first, so a proxy or application reading the last would act for another caller."""

from __future__ import annotations

import pytest

from tests.api.conftest import ApiEnv


@pytest.mark.parametrize("second", ["auditor", "admin"])
def test_two_authorization_headers_are_refused(env: ApiEnv, second: str) -> None:
    headers = [
        ("Authorization", f"Bearer {env.keys['admin']}"),
        ("Authorization", f"Bearer {env.keys[second]}"),
    ]
    r = env.client.request("GET", "/v1/tenants", headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"] == "unauthenticated"
    assert env.keys["admin"] not in r.text
    assert env.call("admin", "GET", "/v1/tenants").status_code == 200  # one header: served
