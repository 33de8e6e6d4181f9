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
