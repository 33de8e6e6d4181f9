"""A sibling subdomain (same site, not same origin) can make an admin's browser fetch the dashboard's
certificate download: SameSite=Strict still sends the cookie to same-site subresource requests, and
the origin check (`kvguard.api.dashboard.csrf.same_origin`) runs on unsafe methods only. Each such GET
is recorded in the audit ledger as a `purge.certificate` export by the admin's key.

Found by a review (each forged GET was answered 200 and left a ledger entry); a navigation to a page
from another site still works."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from kvguard.api.dashboard.session import COOKIE, SECURE_COOKIE
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


def test_a_navigation_from_another_site_cannot_record_a_certificate_export(env: ApiEnv) -> None:
    """A link, `window.open` or self-submitting GET form on a sibling subdomain navigates the
    admin's browser to the download with the Strict cookie: answered, it recorded an `ok` export
    under the admin's key (found by a review). The download is answered to this origin's pages or
    a typed address only; other pages still open from a link."""
    body = {"kind": "session", "value": "chat-1", "tenant_id": "acme"}
    job = env.call("admin", "POST", "/v1/purges", json=body).json()["job_id"]
    cookie = f"{COOKIE}={env.keys['admin']}"
    path = f"/dashboard/purges/{job}/certificate"
    size = env.services.ledger.size
    for site in ("same-site", "cross-site"):
        r = _get(env, path, cookie, site=site, mode="navigate", dest="document")
        assert r.status_code == 403, site
    assert admin_actions(env, "purge.certificate") == []
    assert env.services.ledger.size == size
    for site in ("same-origin", "none"):  # the page's own link; typed or bookmarked
        r = _get(env, path, cookie, site=site, mode="navigate", dest="document")
        assert r.status_code == 200, site
    assert admin_actions(env, "purge.certificate") == ["ok", "ok"]


def test_over_https_the_session_cookie_is_a_host_cookie(env: ApiEnv) -> None:
    """A sibling subdomain can plant `kvguard_session` with `Domain=example.com`: the user then
    browsed as the planter, or, beside a bogus one, could never sign in again (found by a review).
    Over https the session is `__Host-kvguard_session` (Secure, Path=/, no Domain: a browser
    refuses such a cookie from any other host) and the plain name is no session."""
    base = "https://kvguard.example.com"
    client = TestClient(env.client.app, base_url=base, follow_redirects=False)
    r = client.post(
        "/dashboard/login", data={"api_key": env.keys["admin"]}, headers={"Origin": base}
    )
    set_cookie = r.headers["set-cookie"]
    assert r.status_code == 303 and set_cookie.startswith(f"{SECURE_COOKIE}=")
    assert "Secure" in set_cookie and "Path=/;" in set_cookie and "Domain" not in set_cookie
    planted = {"Cookie": f"{COOKIE}={env.keys['globex']}"}  # what a sibling can plant
    assert client.get("/dashboard/", headers=planted).status_code == 303
    ours = {"Cookie": f"{SECURE_COOKIE}={env.keys['admin']}; {COOKIE}=kvg_adm_000000000000_x"}
    assert (
        client.get("/dashboard/", headers=ours).status_code == 200
    )  # a planted bogus one: ignored


def test_an_authorization_header_added_by_a_proxy_does_not_sign_the_user_out(env: ApiEnv) -> None:
    """nginx `auth_basic` or an SSO proxy passes its own `Authorization` upstream: it replaced the
    session's key, so every click was a failed sign-in that cleared the cookie (found by a
    review). On dashboard pages the session cookie alone is the credential."""
    client = TestClient(env.client.app, follow_redirects=False)
    headers = {"Cookie": f"{COOKIE}={env.keys['admin']}", "Authorization": "Basic dXNlcjpwYXNz"}
    for _ in range(12):  # past the failure limit, had each counted as a failed sign-in
        r = client.get("/dashboard/", headers=headers)
        assert r.status_code == 200 and "set-cookie" not in r.headers
    # And a bearer key in the header is no way around the session either.
    bearer = {"Authorization": f"Bearer {env.keys['admin']}"}
    assert client.get("/dashboard/", headers=bearer).status_code == 303
