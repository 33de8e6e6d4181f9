"""The compliance dashboard (`kvguard.api.dashboard`): its session, forgery defence, roles and tenant
scoping (the API's own), that no page holds a secret, its accessibility basics, and one end-to-end
run in a real headless Chromium against a real `kvguard serve` (skipped, with the reason, where
`scripts/install-browser.sh` has not run)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from kvguard.api import app as app_module
from kvguard.api.dashboard import csrf, render, summaries
from kvguard.api.dashboard.session import COOKIE, SECURE_COOKIE
from kvguard.audit import note
from kvguard.audit.certificate import verify_certificate
from kvguard.audit.checkpoint import Checkpoint, format_checkpoint
from kvguard.audit.cosign import WitnessKey
from kvguard.audit.events import EventKind
from kvguard.audit.signing import SigningKey
from kvguard.control.keys import ApiKeys, Principal, Role
from kvguard.control.tenants import TenantRegistry
from kvguard.isolation.keyring import Keyring
from kvguard.policy import PolicySet
from tests.api.conftest import ApiEnv

KVGUARD = str(Path(sys.executable).parent / "kvguard")
ORIGIN = {"Origin": "http://testserver"}
PAGES = (
    "/dashboard/",
    "/dashboard/tenants",
    "/dashboard/tenants/acme",
    "/dashboard/policies",
    "/dashboard/policies/0",
    "/dashboard/purges",
    "/dashboard/ledger",
    "/dashboard/cache",
)


class Browser:
    """A browser-like client holding one key's dashboard session."""

    def __init__(self, env: ApiEnv, who: str, base_url: str = "http://testserver") -> None:
        self.key = env.keys[who]
        self.client = TestClient(env.client.app, base_url=base_url, follow_redirects=False)
        r = self.client.post(
            "/dashboard/login", data={"api_key": self.key}, headers={"Origin": base_url}
        )
        assert r.status_code == 303, r.text

    def get(self, path: str) -> Any:
        return self.client.get(path)

    def post(self, url: str, **fields: str) -> Any:
        """Post a form as the browser would, with its page's token (`csrf.token` of the key: what
        every page renders, test_the_form_token_is_bound_to_the_session_key)."""
        fields.setdefault("csrf_token", csrf.token(self.key))
        return self.client.post(url, data=fields, headers=ORIGIN)


def signed_in(env: ApiEnv, who: str) -> Browser:
    return Browser(env, who)


def token(page: str) -> str:
    found = re.search(r'name="csrf_token" value="([0-9a-f]{64})"', page)
    assert found, "the page has no form"
    return found.group(1)


def admin_actions(env: ApiEnv, name: str) -> list[str]:
    page = env.services.ledger.query(kinds=[EventKind.ADMIN_ACTION], limit=1000)
    return [
        json.loads(r.leaf)["details"]["outcome"]
        for r in page.records
        if json.loads(r.leaf)["details"]["action"] == name
    ]


# --- session ------------------------------------------------------------------------------------


def test_without_a_session_every_page_leads_to_the_login_form(env: ApiEnv) -> None:
    client = TestClient(env.client.app, follow_redirects=False)
    for path in PAGES:
        r = client.get(path)
        assert (r.status_code, r.headers["location"]) == (303, "/dashboard/login"), path
    login = client.get("/dashboard/login")
    assert login.status_code == 200 and '<label for="api_key">' in login.text


def test_the_session_cookie_is_httponly_strict_and_confined_to_the_dashboard(env: ApiEnv) -> None:
    """Over http the cookie is confined to the dashboard's path; over https it is a `__Host-`
    cookie (Path=/ is what that prefix requires: test_dashboard_same_site_get.py)."""
    for base, secure in (("http://testserver", False), ("https://testserver", True)):
        client = TestClient(env.client.app, base_url=base, follow_redirects=False)
        r = client.post(
            "/dashboard/login", data={"api_key": env.keys["auditor"]}, headers={"Origin": base}
        )
        cookie = r.headers["set-cookie"].lower()
        name, path = (SECURE_COOKIE, "/;") if secure else (COOKIE, "/dashboard;")
        assert r.status_code == 303 and cookie.startswith(f"{name.lower()}=")
        assert "httponly" in cookie and "samesite=strict" in cookie and f"path={path}" in cookie
        assert ("; secure" in cookie) is secure
        assert "max-age" not in cookie and "expires" not in cookie  # a session cookie


def test_the_cookie_never_authenticates_the_json_api(env: ApiEnv) -> None:
    cookie = {"Cookie": f"{COOKIE}={env.keys['admin']}"}
    assert env.client.get("/v1/tenants", headers=cookie).status_code == 401


def test_a_wrong_key_is_refused_by_the_apis_own_check_and_limiter(
    make_env: Callable[..., ApiEnv],
) -> None:
    env = make_env(auth_max_failures=2)
    client = TestClient(env.client.app, follow_redirects=False)
    bad = env.keys["admin"][:-1] + ("A" if env.keys["admin"][-1] != "A" else "B")
    statuses = []
    for _ in range(3):
        r = client.post("/dashboard/login", data={"api_key": bad}, headers=ORIGIN)
        statuses.append(r.status_code)
        assert "set-cookie" not in r.headers and bad not in r.text
    assert statuses == [401, 401, 429] and r.headers["retry-after"]
    # The API's limiter counted the dashboard's failures: the JSON API is limited for this client too.
    assert (
        env.client.get("/v1/tenants", headers={"Authorization": f"Bearer {bad}"}).status_code == 429
    )


def test_a_revoked_key_loses_its_session_at_the_next_request(env: ApiEnv) -> None:
    client = signed_in(env, "auditor")
    assert client.get("/dashboard/").status_code == 200
    env.services.keys.revoke(env.keys["auditor"].split("_")[2])
    r = client.get("/dashboard/")
    assert (r.status_code, r.headers["location"]) == (303, "/dashboard/login")
    assert (
        f'{COOKIE}=""' in r.headers["set-cookie"] and "max-age=0" in r.headers["set-cookie"].lower()
    )


def test_signing_out_clears_the_cookie(env: ApiEnv) -> None:
    client = signed_in(env, "admin")
    assert client.get("/dashboard/logout").status_code == 405  # a link cannot sign anyone out
    r = client.post("/dashboard/logout")  # with the page's token, as every form
    assert r.status_code == 303 and "max-age=0" in r.headers["set-cookie"].lower()
    assert "Signed out." in client.get(r.headers["location"]).text
    assert client.get("/dashboard/").status_code == 303


class _Lines:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


def test_dashboard_requests_are_in_the_access_log_with_route_and_key(
    env: ApiEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = signed_in(env, "auditor")
    log = _Lines()
    monkeypatch.setattr(app_module, "_log", log)
    client.get("/dashboard/tenants/acme")
    key_id = env.keys["auditor"].split("_")[2]
    assert [(e["route"], e["status"], e["key_id"]) for e in log.lines] == [
        ("/dashboard/tenants/{tenant_id}", 200, key_id)
    ]
    assert env.keys["auditor"] not in repr(log.lines)


def test_every_answer_carries_the_security_headers(env: ApiEnv) -> None:
    client = signed_in(env, "admin")
    for r in (
        client.get("/dashboard/login"),
        client.get("/dashboard/"),
        client.get("/dashboard/nope"),
    ):
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src" not in csp
        assert "frame-ancestors 'none'" in csp and r.headers["x-frame-options"] == "DENY"
        assert (
            r.headers["cache-control"] == "no-store"
            and r.headers["referrer-policy"] == "same-origin"
        )
    assert client.get("/dashboard/nope").headers["content-type"].startswith("text/html")


# --- forged requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "fields"),
    [
        pytest.param(ORIGIN, {}, id="no-token"),
        pytest.param(ORIGIN, {"csrf_token": "0" * 64}, id="wrong-token"),
        pytest.param(ORIGIN, {"csrf_token": csrf.token("kvg_adm_000000000000_x")}, id="other-key"),
        pytest.param({"Origin": "https://evil.example"}, None, id="cross-origin"),
        pytest.param({"Referer": "http://testserver.evil.example/x"}, None, id="cross-referer"),
        pytest.param({}, None, id="no-origin"),
        pytest.param({**ORIGIN, "Sec-Fetch-Site": "same-site"}, None, id="same-site-only"),
    ],
)
def test_a_forged_form_post_is_refused_and_leaves_no_trace(
    env: ApiEnv, headers: dict[str, str], fields: dict[str, str] | None
) -> None:
    client = signed_in(env, "admin")
    good = token(client.get("/dashboard/tenants").text)
    size = env.services.ledger.size
    data = {"tenant_id": "forged", **({"csrf_token": good} if fields is None else fields)}
    r = client.client.post("/dashboard/tenants", data=data, headers=headers)
    assert r.status_code == 403 and "text/html" in r.headers["content-type"]
    assert "forged" not in [t.tenant_id for t in env.services.tenants.list()]
    assert env.services.ledger.size == size  # refused before the audited action ran


def test_the_form_token_is_bound_to_the_session_key(env: ApiEnv) -> None:
    admin, acme = signed_in(env, "admin"), signed_in(env, "acme")
    assert token(admin.get("/dashboard/tenants").text) == csrf.token(env.keys["admin"])
    assert token(acme.get("/dashboard/tenants/acme").text) != csrf.token(env.keys["admin"])
    r = admin.post("/dashboard/tenants", tenant_id="initech")
    assert (r.status_code, r.headers["location"]) == (
        303,
        "/dashboard/tenants/initech?notice=tenant-created",
    )


# --- roles and tenant scoping (the API's) --------------------------------------------------------


def _globex_job(env: ApiEnv) -> int:
    body = {"kind": "session", "value": "chat-1", "tenant_id": "globex"}
    return int(env.call("admin", "POST", "/v1/purges", json=body).json()["job_id"])


@pytest.mark.parametrize(
    ("who", "forbidden"),
    [
        ("admin", set()),
        ("auditor", set()),
        ("acme", {"/dashboard/policies", "/dashboard/policies/0"}),
    ],
)
def test_pages_follow_the_api_roles(env: ApiEnv, who: str, forbidden: set[str]) -> None:
    client = signed_in(env, who)
    for path in PAGES:
        assert client.get(path).status_code == (403 if path in forbidden else 200), path


def test_a_tenant_admin_sees_only_its_tenant(env: ApiEnv) -> None:
    job = _globex_job(env)
    env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    client = signed_in(env, "acme")
    globex_tag = env.services.deriver.tenant_tag("globex")
    for path in (p for p in PAGES if "policies" not in p):
        text = client.get(path).text
        assert "globex" not in text.lower() and globex_tag not in text, path
    for path in (
        "/dashboard/tenants/globex",
        f"/dashboard/purges/{job}",
        f"/dashboard/purges/{job}/certificate",
    ):
        assert client.get(path).status_code == 404, path
    assert "acme" in client.get("/dashboard/tenants").text


def test_actions_are_the_apis_own_with_its_roles_and_ledger_entries(env: ApiEnv) -> None:
    auditor, acme, admin = (
        signed_in(env, "auditor"),
        signed_in(env, "acme"),
        signed_in(env, "admin"),
    )
    assert auditor.post("/dashboard/tenants", tenant_id="x1").status_code == 403
    assert auditor.post("/dashboard/purges", kind="tenant", value="acme").status_code == 403
    assert acme.post("/dashboard/tenants", tenant_id="x2").status_code == 403
    assert acme.post("/dashboard/purges", kind="tenant", value="globex").status_code == 404
    assert acme.post("/dashboard/purges", kind="model", value="m").status_code == 403
    assert acme.post("/dashboard/policies", policy="{}", reason="r").status_code == 403
    assert admin_actions(env, "tenant.create") == ["denied", "denied"]
    assert admin_actions(env, "purge.create") == ["denied", "not_found", "denied"]
    r = acme.post("/dashboard/purges", kind="session", value="chat-9", tenant_id="acme")
    assert r.status_code == 303 and r.headers["location"].startswith("/dashboard/purges/")
    assert admin_actions(env, "purge.create")[-1] == "ok"
    issued = env.call("acme", "POST", "/v1/tenants/acme/inference-keys").json()
    r = acme.post(f"/dashboard/tenants/acme/inference-keys/{issued['key_id']}/revoke")
    assert (
        r.status_code == 303 and env.services.inference_keys.tenant_for(issued["api_key"]) is None
    )
    r = admin.post("/dashboard/tenants/globex/disable", reason="contract ended")
    assert r.status_code == 303 and not env.services.tenants.get("globex").enabled
    assert admin.post("/dashboard/ledger/checkpoints").status_code == 303


def test_invalid_input_is_a_page_naming_the_field_without_echoing_it(env: ApiEnv) -> None:
    admin = signed_in(env, "admin")
    r = admin.post("/dashboard/tenants", tenant_id="bad id/<b>")
    assert r.status_code == 422 and "form.tenant_id" in r.text and "bad id" not in r.text
    r = admin.post(
        "/dashboard/policies", policy="tenants: {acme: {retention: {ttl_s: -1}}}", reason="r"
    )
    assert r.status_code == 422 and "ttl_s" in r.text
    # A key pasted into the document (as a field name, a YAML tag, a JSON key) is masked as the
    # JSON API masks it in a body's field paths (found by a review: the form echoed it).
    secret = env.keys["admin"]
    for document in (
        f"tenants: {{acme: {{{secret}: 1}}}}",
        f"!{secret} x",
        f'{{"tenants": {{"acme": {{"{secret}": 1}}}}}}',
        f"tenants: {{acme: {{reuse: {secret}}}}}",
        f"tenants: {{acme: {{}}, acme: {{}}}}\n# {secret}",
        f"tenants: {{acme: {{{'x' * 70}: 1}}}}",
    ):
        r = admin.post("/dashboard/policies", policy=document, reason="r")
        assert r.status_code == 422, document
        assert secret not in r.text and secret.split("_")[-1] not in r.text, document
        assert "x" * 70 not in r.text


# --- policies, purges, ledger --------------------------------------------------------------------


def test_policy_history_shows_each_versions_diff_and_refuses_a_stale_edit(env: ApiEnv) -> None:
    admin = signed_in(env, "admin")
    for ttl, expected in ((600, "0"), (300, "1")):
        doc = f"tenants:\n  acme:\n    retention: {{ttl_s: {ttl}, idle_s: 60}}\n"
        r = admin.post(
            "/dashboard/policies", policy=doc, reason=f"CR-{ttl}", expected_version=expected
        )
        assert r.status_code == 303, r.text
    assert r.headers["location"] == "/dashboard/policies/2?notice=policy-stored"
    history = signed_in(env, "auditor").get("/dashboard/policies").text
    assert re.search(r'diff-removed">-\s+&#34;ttl_s&#34;: 600<', history)
    assert re.search(r'diff-added">\+\s+&#34;ttl_s&#34;: 300<', history)
    detail = admin.get("/dashboard/policies/2").text
    assert "tenants.acme.retention.ttl_s" in detail and "Changes from version 1" in detail
    r = admin.post("/dashboard/policies", policy="{}", reason="stale", expected_version="1")
    assert r.status_code == 412


def test_a_purge_page_verifies_the_certificate_and_the_download_verifies_offline(
    env: ApiEnv,
) -> None:
    admin = signed_in(env, "admin")
    r = admin.post("/dashboard/purges", kind="tenant", value="acme")
    job_page = admin.get(r.headers["location"]).text
    assert "Offline verification on this server: <strong>valid</strong>" in job_page
    assert "kvguard verify" in job_page
    download = signed_in(env, "auditor").get(r.headers["location"].split("?")[0] + "/certificate")
    assert 'filename="erasure-certificate-' in download.headers["content-disposition"]
    assert env.signing_key is not None
    report = verify_certificate(
        download.json(), [env.signing_key.verifier_key()], origin="kvguard.test/ledger"
    )
    assert report.job_id == int(r.headers["location"].split("/")[3].split("?")[0])
    assert admin_actions(env, "purge.certificate") == ["ok"]  # the download, as in the API


def test_a_tampered_certificate_is_shown_invalid() -> None:
    shown = summaries.verify(
        {"format": "kvguard/erasure-certificate", "version": 1}, ["x+00000000+AA=="], "o"
    )
    assert not shown.valid and shown.detail


def test_checkpoint_signers_tell_the_log_a_witness_and_an_unknown_key_apart() -> None:
    log, witness, stranger = (
        SigningKey.generate("log.test/l"),
        WitnessKey.generate("w1"),
        WitnessKey.generate("w2"),
    )
    text = format_checkpoint(Checkpoint("log.test/l", 3, b"\x01" * 32))
    signed = note.join_note(
        text,
        [
            log.signature_line(text),
            witness.cosignature_line(text, 1_795_000_000),
            stranger.cosignature_line(text, 5),
        ],
    )
    signers = summaries.checkpoint_signers(signed, [log.verifier()], [witness.verifier()])
    assert [(s.name, s.role.value) for s in signers] == [
        ("log.test/l", "log"),
        ("w1", "witness"),
        ("w2", "unknown"),
    ]
    assert signers[1].cosigned_at == 1_795_000_000
    assert summaries.missing_witnesses(signers, [witness.verifier()]) == []
    other = WitnessKey.generate("w1").verifier()  # the name w1, another key: its line is not w1's
    again = summaries.checkpoint_signers(signed, [log.verifier()], [other])
    assert again[1].role.value == "unknown" and summaries.missing_witnesses(again, [other]) == [
        "w1"
    ]
    forged = signed.replace(signed.splitlines()[-3][-8:], "AAAAAAA=")  # break the log's signature
    assert summaries.checkpoint_signers(forged, [log.verifier()], [])[0].role.value == "invalid"


def test_policy_text_is_canonical_and_diffs_are_classified() -> None:
    old = summaries.policy_text(PolicySet())
    new = summaries.policy_text(PolicySet.model_validate({"epoch": 1}))
    lines = summaries.text_diff(old, new, old_name="a", new_name="b")
    assert [line.kind.value for line in lines][:3] == ["file", "file", "hunk"]
    assert {line.text for line in lines if line.kind.value != "context"} >= {
        '-  "epoch": 0,',
        '+  "epoch": 1,',
    }
    assert summaries.text_diff(old, old, old_name="a", new_name="a") == []


class _Links(HTMLParser):
    """Every `href` and form `action` of a page, as a browser reads them (entities decoded)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in {"href", "action"} and v is not None]


def test_links_to_a_stored_id_encode_it_as_one_path_segment(env: ApiEnv) -> None:
    """A stored tenant id went into `href` as it was: `/`, `?`, `#` or `%` in it pointed the link
    at another path, query or fragment (the API refuses such ids at creation, but the dashboard
    renders what the database holds, e.g. a row written before the rule or by hand)."""
    weird = "we/../ird?x=1#frag%2e\"q'<b>"
    with env.services.db.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tenants (tenant_id, display_name, created_at, created_by) "
                "VALUES (:t, 'Weird', 0, 'test')"
            ),
            {"t": weird},
        )
    page = signed_in(env, "admin").get("/dashboard/tenants").text
    links = _Links()
    links.feed(page)
    encoded = "we%2F..%2Fird%3Fx%3D1%23frag%252e%22q%27%3Cb%3E"
    assert f"/dashboard/tenants/{encoded}" in links.urls
    assert not any(url.startswith("/dashboard/tenants/we/") for url in links.urls)
    assert "<b>" not in page  # the link text is escaped too
    nav = render.navigation(Principal("k1", Role.TENANT_ADMIN, weird), "/dashboard/")
    assert f"/dashboard/tenants/{encoded}" in [item.href for item in nav]
    assert render.dashboard_path("purges", 7) == "/dashboard/purges/7"


# --- no secrets, accessibility -------------------------------------------------------------------


def _secrets(env: ApiEnv, inference_key: str) -> list[str]:
    assert env.signing_key is not None
    keyring = json.loads(
        next(env.services.config.salt_keyring_file.parent.glob("salt.keys")).read_text()
    )
    return [
        *env.keys.values(),
        # The secret part of `kvg_adm_<hex id>_<secret>` (the secret itself may contain "_").
        *(k.removeprefix("kvg_adm_").split("_", 1)[1] for k in env.keys.values()),
        inference_key,
        env.signing_key.encode(),
        # The base64 seed of `PRIVATE+KEY+<name>+<hex id>+<base64>` (base64 may contain "+").
        env.signing_key.encode().split("+", 4)[4],
        *keyring["keys"].values(),
    ]


def test_no_page_holds_a_secret(env: ApiEnv) -> None:
    inference_key = env.call("admin", "POST", "/v1/tenants/acme/inference-keys").json()["api_key"]
    env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    env.call("admin", "POST", "/v1/audit/checkpoints")
    secrets = _secrets(env, inference_key)
    for who in ("admin", "auditor", "acme"):
        client = signed_in(env, who)
        for path in (*PAGES, "/dashboard/purges/1", "/dashboard/login", "/dashboard/nope"):
            text = client.get(path).text
            assert not [s for s in secrets if s in text], (who, path)


class _Controls(HTMLParser):
    """Form controls, their labels and the first focusable element of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.controls: list[dict[str, str | None]] = []
        self.labels: set[str] = set()
        self.first_focusable: dict[str, str | None] | None = None
        self.header_cells: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "label" and a.get("for"):
            self.labels.add(str(a["for"]))
        if tag in {"input", "select", "textarea"} and a.get("type") != "hidden":
            self.controls.append(a)
        if tag == "th":
            self.header_cells.append(a)
        focusable = (
            tag in {"a", "button", "input", "select", "textarea"} and a.get("type") != "hidden"
        )
        if self.first_focusable is None and focusable:
            self.first_focusable = {"tag": tag, **a}


def test_every_control_has_a_label_tables_have_scoped_headers_and_the_skip_link_comes_first(
    env: ApiEnv,
) -> None:
    env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    env.call("admin", "POST", "/v1/tenants/acme/inference-keys")
    client = signed_in(env, "admin")
    for path in (*PAGES, "/dashboard/purges/1", "/dashboard/login"):
        html = client.get(path).text
        parsed = _Controls()
        parsed.feed(html)
        assert parsed.first_focusable == {"tag": "a", "class": "skip-link", "href": "#main"}, path
        assert all(c.get("id") in parsed.labels for c in parsed.controls), path
        assert all(th.get("scope") in {"col", "row"} for th in parsed.header_cells), path
        assert '<main id="main"' in html and ("<nav " in html or path == "/dashboard/login")


# --- end to end: a real browser against a real `kvguard serve` ------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
E2E_ORIGIN = "kvguard.test/dashboard"
ENABLED_CONTROLS = "input:not([type=hidden]), select, textarea"


def _playwright_or_skip() -> Any:
    if not CHROMIUM.exists():
        pytest.skip(
            "Debian's chromium is not installed (/usr/bin/chromium): run scripts/install-browser.sh"
        )
    try:
        from playwright import sync_api  # noqa: PLC0415
    except ImportError:
        pytest.skip("the playwright package is not installed: run scripts/install-browser.sh")
    return sync_api


@dataclass
class Served:
    url: str
    keys: dict[str, str]
    verifier_key: str


@contextmanager
def _serve(directory: Path) -> Iterator[Served]:
    """`kvguard serve` on a fresh SQLite database with tenants acme and globex and three keys."""
    signing = SigningKey.generate(E2E_ORIGIN)
    signing.save(directory / "signing.key")
    Keyring.generate("k1").save(directory / "salt.keys")
    db_url = f"sqlite:///{directory / 'kvguard.db'}"
    engine = sa.create_engine(db_url)
    for tenant in ("acme", "globex"):
        TenantRegistry(engine).create(tenant, display_name=tenant.title(), created_by="test")
    keys = ApiKeys(engine)
    issued = {
        "admin": keys.create(Role.ADMIN).api_key,
        "acme": keys.create(Role.TENANT_ADMIN, tenant_id="acme").api_key,
    }
    engine.dispose()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {
        **os.environ,
        "KVGUARD_SIGNING_KEY_FILE": str(directory / "signing.key"),
        "KVGUARD_SALT_KEYRING_FILE": str(directory / "salt.keys"),
        "KVGUARD_DATA_DIR": str(directory),
    }
    env.pop("KVGUARD_MODE", None)
    args = ["serve", "--db", db_url, "--port", str(port), "--origin", E2E_ORIGIN]
    log = directory / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([KVGUARD, *args], env=env, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("kvguard serve did not start: " + log.read_text(errors="replace"))
        yield Served(url, issued, signing.verifier_key())
    finally:
        proc.terminate()
        proc.wait(15)


def _assert_accessible_controls(page: Any) -> None:
    """Every visible form control has a label (`<label for>`), found by `get_by_label`, and every
    button has an accessible name."""
    unlabelled = page.eval_on_selector_all(
        ENABLED_CONTROLS, "els => els.filter(e => e.labels.length === 0).map(e => e.name)"
    )
    assert unlabelled == [], page.url
    for label in page.locator("label").all():
        assert page.get_by_label(label.inner_text(), exact=True).count() == 1, label.inner_text()
    for button in page.get_by_role("button").all():
        assert button.inner_text().strip() or button.get_attribute("aria-label"), page.url


def _sign_in_with_the_keyboard(page: Any, api_key: str) -> None:
    """Tab: the skip link comes first; Enter moves focus to the main content; Tab reaches the key
    field; Enter submits the form."""
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to main content"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "api_key"
    page.keyboard.type(api_key)
    page.keyboard.press("Enter")
    page.wait_for_url("**/dashboard/")


@pytest.mark.slow
def test_in_a_real_browser_an_admin_purges_and_verifies_and_a_tenant_admin_sees_only_its_own(
    tmp_path: Path,
) -> None:
    sync_api = _playwright_or_skip()
    expect = sync_api.expect
    with _serve(tmp_path) as served, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_context(base_url=served.url, accept_downloads=True).new_page()
            page.goto("/dashboard/tenants")
            assert page.url.endswith("/dashboard/login")
            _assert_accessible_controls(page)
            _sign_in_with_the_keyboard(page, served.keys["admin"])

            page.get_by_role("navigation", name="Main").get_by_role("link", name="Tenants").click()
            _assert_accessible_controls(page)
            page.get_by_label("Tenant id").fill("initech")
            page.get_by_label("Display name").fill("Initech Corp")
            page.get_by_role("button", name="Create tenant").click()
            expect(page.get_by_role("status")).to_have_text("Tenant created.")
            _assert_accessible_controls(page)
            page.get_by_role("button", name="Purge tenant initech").click()
            expect(page.get_by_role("status")).to_have_text("Purge queued for every engine.")
            expect(page.locator("#verification")).to_contain_text("valid")
            with page.expect_download() as download:
                page.get_by_role("link", name="Download certificate (JSON)").click()
            certificate = tmp_path / download.value.suggested_filename
            download.value.save_as(certificate)
            verified = subprocess.run(
                [
                    KVGUARD,
                    "verify",
                    str(certificate),
                    "--key",
                    served.verifier_key,
                    "--origin",
                    E2E_ORIGIN,
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert verified.returncode == 0, verified.stdout + verified.stderr
            for path in ("/dashboard/purges", "/dashboard/policies", "/dashboard/tenants/initech"):
                page.goto(path)
                _assert_accessible_controls(page)

            tenant_page = browser.new_context(base_url=served.url).new_page()
            tenant_page.goto("/dashboard/")
            tenant_page.get_by_label("Admin API key").fill(served.keys["acme"])
            tenant_page.get_by_role("button", name="Sign in").click()
            tenant_page.get_by_role("link", name="My tenant").click()
            expect(tenant_page.get_by_role("heading", level=1)).to_have_text("Tenant acme")
            for path in (
                "/dashboard/",
                "/dashboard/tenants",
                "/dashboard/purges",
                "/dashboard/cache",
            ):
                assert tenant_page.goto(path).status == 200
                assert "globex" not in tenant_page.content().lower(), path
                assert "initech" not in tenant_page.content().lower(), path
            assert tenant_page.goto("/dashboard/tenants/globex").status == 404
            assert tenant_page.goto("/dashboard/tenants/initech").status == 404
            assert tenant_page.goto("/dashboard/policies").status == 403
        finally:
            browser.close()


def test_tenant_page_says_when_it_shows_only_the_newest_keys(
    env: ApiEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant page lists the newest page of inference keys and says where the rest are."""
    import kvguard.api.routes.inference_keys as keys_route  # noqa: PLC0415

    client = signed_in(env, "auditor")
    for _ in range(3):
        env.services.inference_keys.issue("acme")
    assert "The newest" not in client.get("/dashboard/tenants/acme").text
    listing = keys_route.list_inference_keys
    monkeypatch.setattr(
        keys_route, "list_inference_keys", lambda t, a: listing(t, a, after=None, limit=2)
    )
    page = client.get("/dashboard/tenants/acme").text
    assert "The newest 2 keys" in page and page.count("<code>") >= 2


def test_the_bare_prefix_leads_to_the_overview_by_a_path(env: ApiEnv) -> None:
    """The app has Starlette's trailing-slash redirects off (they built `Location` from the `Host`
    header); `/dashboard` still reaches the overview, by a path."""
    browser = signed_in(env, "admin")
    r = browser.client.get("/dashboard", headers={"Host": "evil.example"})
    assert (r.status_code, r.headers["location"]) == (307, "/dashboard/"), r.headers
    assert browser.get("/dashboard/").status_code == 200
