"""Error answers held to the documented error contract (docs/api.md,
"Errors": `message` names the field and never echoes the value sent; `fields` names it; 400 only for a
body that cannot be parsed)."""

from __future__ import annotations

from tests.api.conftest import ApiEnv


def test_undefined_share_group_is_a_field_error_that_does_not_echo_the_document(
    env: ApiEnv,
) -> None:
    """An admin tenant PUT naming a share group the set does not define: a field error naming
    `tenants.acme.groups.0`, not pydantic's raw text (which carried `input_value=` and the value)."""
    secret = "do-not-echo-this-value"
    r = env.call(
        "admin",
        "PUT",
        "/v1/tenants/acme/policy",
        json={"policy": {"groups": [secret]}, "reason": "join"},
    )
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["fields"], body  # the field (tenants.acme.groups) is named
    assert secret not in body["message"] and "input_value" not in body["message"], body


def test_disabling_an_overlong_unknown_tenant_id_is_404_not_400(env: ApiEnv) -> None:
    """POST /v1/tenants/<201+ chars>/disable: the refusal's ledger entry carried the id from the
    URL, which the ledger refuses ('reads like free text'), and the caller got 400 bad_request
    instead of the 404 any other unknown tenant gets. Now the entry names only registered ids."""
    for length in (150, 201, 5000):
        r = env.call("admin", "POST", f"/v1/tenants/{'a' * length}/disable", json={"reason": "x"})
        assert r.status_code == 404 and r.json()["error"] == "not_found", (length, r.text)


def test_a_404_never_echoes_the_id_sent(env: ApiEnv) -> None:
    """An unknown tenant id from the path is not repeated in the answer (docs/api.md: a message
    never echoes the value sent): whatever a caller puts in a URL is not reflected back."""
    probe = "no-such-tenant-reflected-text"
    for method, path, body in (
        ("GET", f"/v1/tenants/{probe}", None),
        ("POST", f"/v1/tenants/{probe}/disable", {"reason": "x"}),
        ("GET", f"/v1/tenants/{probe}/policy", None),
    ):
        r = env.call("admin", method, path, json=body)
        assert r.status_code == 404 and probe not in r.text, (path, r.text)


def test_a_trailing_slash_is_a_404_never_a_redirect_built_from_the_host_header(env: ApiEnv) -> None:
    """Starlette answered `/v1/tenants/` with a 307 whose `Location` came from the request's `Host`
    header (`http://evil.example/v1/tenants`): behind a proxy that passes `Host` through, a cached
    redirect could send users elsewhere. Now such a path is an unknown route (the documented error
    body), and the dashboard's bare prefix redirects by a path."""
    hostile = {"Host": "evil.example"}
    for path in ("/v1/tenants/", "/v1/policies/current/", "/healthz/"):
        r = env.call("admin", "GET", path, headers=hostile, follow_redirects=False)
        assert r.status_code == 404, (path, r.status_code, r.headers)
        assert "location" not in r.headers and r.json()["error"] == "not_found", (path, r.text)
    r = env.call(None, "GET", "/v1/tenants/", headers=hostile, follow_redirects=False)
    assert r.status_code == 401 and "location" not in r.headers, r.headers  # no key: no route
    for path in ("/dashboard", "/dashboard/tenants/"):
        r = env.client.get(path, headers=hostile, follow_redirects=False)
        assert r.headers.get("location", "/").startswith("/dashboard"), (path, r.headers)
    assert env.client.get("/dashboard", follow_redirects=True).status_code == 200
