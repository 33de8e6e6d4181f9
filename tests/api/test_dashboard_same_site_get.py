"""A sibling subdomain (same site, not same origin) can make an admin's browser fetch the dashboard's
certificate download: SameSite=Strict still sends the cookie to same-site subresource requests, and
the origin check (`kvguard.api.dashboard.csrf.same_origin`) runs on unsafe methods only. Each such GET
is recorded in the audit ledger as a `purge.certificate` export by the admin's key.

Found by a review (each forged GET was answered 200 and left a ledger entry); a navigation to a page
from another site still works."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from kvguard.api.dashboard.session import COOKIE
from tests.api.conftest import ApiEnv
from tests.api.test_dashboard import admin_actions


def _get(env: ApiEnv, path: str, cookie: str, **fetch: str) -> Any:
    """GET `path` as a browser would with this cookie header and these `Sec-Fetch-*` values."""
    client = TestClient(env.client.app, follow_redirects=False)
    headers = {"Cookie": cookie, **{f"Sec-Fetch-{k.title()}": v for k, v in fetch.items()}}
    return client.get(path, headers=headers)


def test_a_same_site_subresource_get_cannot_record_a_certificate_export(env: ApiEnv) -> None:
    body = {"kind": "session", "value": "chat-1", "tenant_id": "acme"}
    job = env.call("admin", "POST", "/v1/purges", json=body).json()["job_id"]
    size = env.services.ledger.size
    # What Chromium sends for <img src="https://kvguard.example.com/dashboard/purges/N/certificate">
    # on a page of evil.example.com: the Strict cookie (same site) and Sec-Fetch-Site: same-site.
    cookie = f"{COOKIE}={env.keys['admin']}"
    r = _get(
        env,
        f"/dashboard/purges/{job}/certificate",
        cookie,
        site="same-site",
        mode="no-cors",
        dest="image",
    )
    assert r.status_code == 403
    assert admin_actions(env, "purge.certificate") == []
    assert env.services.ledger.size == size


def test_a_navigation_from_another_site_still_opens_a_page(env: ApiEnv) -> None:
    cookie = f"{COOKIE}={env.keys['admin']}"
    r = _get(env, "/dashboard/tenants", cookie, site="same-site", mode="navigate", dest="document")
    assert r.status_code == 200


def test_two_session_cookies_are_no_session(env: ApiEnv) -> None:
    """A cookie planted by a sibling subdomain on a narrower path is sent first: with two, the
    dashboard signs nobody in rather than the planter (found by a review)."""
    planted = f"{COOKIE}={env.keys['globex']}; {COOKIE}={env.keys['admin']}"
    r = _get(env, "/dashboard/tenants", planted)
    assert r.status_code == 303 and r.headers["location"].endswith("/dashboard/login")
