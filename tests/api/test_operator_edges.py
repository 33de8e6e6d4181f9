"""Edges of the operator's path found by an independent black-box review (twelfth session:
docs/operations.md, docs/cli.md, docs/dashboard.md, docs/policy.md followed literally). Each test
failed on the code before its fix."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kvguard.api.dashboard import csrf
from kvguard.cli import app
from kvguard.cli_output import safe_url
from kvguard.control import db as control_db
from kvguard.control.keys import ApiKeys, Role
from kvguard.control.tenants import TenantRegistry
from kvguard.errors import PolicyValidationError
from kvguard.isolation.keyring import Keyring
from kvguard.policy import parse_policy
from tests.api.conftest import ApiEnv
from tests.dbs import fresh_pg_database

runner = CliRunner()
KVGUARD = str(Path(sys.executable).parent / "kvguard")
ORIGIN = {"Origin": "http://testserver"}
DEEP_YAML = "epoch: " + "[" * 20000 + "]" * 20000 + "\n"
DEEP_JSON = '{"epoch": ' + "[" * 20000 + "]" * 20000 + "}"
HUGE_INT_YAML = "epoch: " + "9" * 5000 + "\n"


def _no_crash(result) -> None:  # type: ignore[no-untyped-def]
    """A CLI result that ended by the command's own exit, not by an uncaught exception."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"uncaught {type(result.exception).__name__}: {result.output[-400:]}"
    )
    assert "Traceback" not in result.output


def _browser(env: ApiEnv, who: str = "admin") -> TestClient:
    client = TestClient(env.client.app, follow_redirects=False, raise_server_exceptions=False)
    r = client.post("/dashboard/login", data={"api_key": env.keys[who]}, headers=ORIGIN)
    assert r.status_code == 303
    return client


# --- 1. hostile policy documents ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fmt"),
    [(DEEP_YAML, "yaml"), (DEEP_JSON, "json"), (HUGE_INT_YAML, "yaml")],
    ids=["deep-yaml", "deep-json", "huge-int"],
)
def test_parse_policy_reports_hostile_documents_as_validation_errors(text: str, fmt: str) -> None:
    """docs/policy.md: every problem is a (field path, message); parse_policy raises
    PolicyValidationError. A deeply nested document raised RecursionError, a 5000-digit integer a
    bare ValueError."""
    with pytest.raises(PolicyValidationError):
        parse_policy(text, "p", fmt=fmt)  # type: ignore[arg-type]


@pytest.mark.parametrize("content", [DEEP_YAML, HUGE_INT_YAML], ids=["deep", "huge-int"])
def test_policy_validate_cli_reports_hostile_file_without_traceback(
    tmp_path: Path, content: str
) -> None:
    """`kvguard policy validate FILE` printed a Python traceback (exit 1 from the crash)."""
    path = tmp_path / "hostile.yaml"
    path.write_text(content)
    result = runner.invoke(app, ["policy", "validate", str(path)])
    _no_crash(result)
    assert result.exit_code == 1
    assert f"{path}: " in result.output


def test_dashboard_policy_form_refuses_deeply_nested_document_with_4xx(env: ApiEnv) -> None:
    """POST /dashboard/policies with a deeply nested document answered 500 (RecursionError)."""
    browser = _browser(env)
    r = browser.post(
        "/dashboard/policies",
        data={"policy": DEEP_YAML, "reason": "r", "csrf_token": csrf.token(env.keys["admin"])},
        headers=ORIGIN,
    )
    assert r.status_code in {400, 422}, r.status_code
    assert r.headers["content-type"].startswith("text/html")


def test_dashboard_error_message_never_echoes_the_value_sent(env: ApiEnv) -> None:
    """docs/dashboard.md: errors name the field, never the value sent. `expected_version=²`
    (str.isdigit() is true, int() fails) answered 'invalid literal for int() ...: '²''."""
    browser = _browser(env)
    r = browser.post(
        "/dashboard/policies",
        data={
            "policy": "epoch: 0",
            "reason": "r",
            "expected_version": "\u00b2",
            "csrf_token": csrf.token(env.keys["admin"]),
        },
        headers=ORIGIN,
    )
    assert r.status_code == 422
    assert "\u00b2" not in r.text and "&#39;²&#39;" not in r.text
    assert "expected_version" in r.text


# --- 2. dashboard security headers on server errors -----------------------------------------------


def test_dashboard_server_error_keeps_security_headers(
    env: ApiEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/dashboard.md: CSP, X-Frame-Options: DENY and Cache-Control: no-store on *every*
    dashboard answer. A 500 (any unexpected exception in a view) came back as the API's JSON error
    without any of them."""
    from kvguard.api.routes import cache  # noqa: PLC0415

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(cache, "engines", broken)
    r = _browser(env).get("/dashboard/cache")
    assert r.status_code == 500
    assert r.headers.get("x-frame-options") == "DENY"
    assert "frame-ancestors 'none'" in r.headers.get("content-security-policy", "")
    assert r.headers.get("cache-control") == "no-store"


# --- 3. secrets in printed database URLs --------------------------------------------------------------


def test_safe_url_masks_a_password_given_as_a_query_parameter() -> None:
    """docs/cli.md: database URLs are printed with the password masked; docs/operations.md tells
    operators to put libpq parameters in the URL's query, and libpq takes `password` there."""
    assert "s3cretpw" not in safe_url("postgresql+psycopg://app@db/kvguard?password=s3cretpw")


def test_db_migrate_error_does_not_print_the_password(tmp_path: Path) -> None:
    url = "postgresql+psycopg://app@127.0.0.1:1/kvguard?password=s3cretpw&connect_timeout=2"
    result = runner.invoke(app, ["db", "migrate", "--db", url, "--json"])
    assert result.exit_code == 2
    assert "s3cretpw" not in result.output


# --- 4. migrations: a database at a newer revision ------------------------------------------------


def test_db_migrate_on_a_newer_schema_is_a_clear_usage_error(tmp_path: Path) -> None:
    """A database migrated by a newer release (rollback, rolling upgrade): every command died
    with alembic's CommandError traceback and exit 1 ("the answer is no")."""
    url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    assert runner.invoke(app, ["db", "migrate", "--db", url]).exit_code == 0
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE control_alembic_version SET version_num = '0099_future'")
    engine.dispose()
    for args in (
        ["db", "migrate", "--db", url],
        ["keys", "create", "--role", "admin", "--db", url],
    ):
        result = runner.invoke(app, args)
        _no_crash(result)
        assert result.exit_code == 2, (args, result.exit_code)


# --- 5. CLI values that are reported as something else ---------------------------------------------


@pytest.mark.postgres
def test_purge_with_an_overlong_session_id_names_the_value_not_the_database() -> None:
    """`kvguard purge --tenant acme --session <300 chars>` on PostgreSQL said 'cannot open
    database ...: DataError' although the database opened fine (the API answers 422 naming
    `value`)."""
    with fresh_pg_database("kvg_review") as url:
        assert runner.invoke(app, ["db", "migrate", "--db", url]).exit_code == 0
        engine = sa.create_engine(url)
        TenantRegistry(engine).create("acme", display_name="Acme", created_by="t")
        engine.dispose()
        result = runner.invoke(
            app, ["purge", "--db", url, "--tenant", "acme", "--session", "s" * 300, "--json"]
        )
    assert result.exit_code == 2, result.output
    assert "cannot open database" not in result.output
    assert "session" in result.output


def test_db_grants_refuses_the_reserved_role_public() -> None:
    """`kvguard db grants public` printed grants TO public (every role), including DELETE on
    ledger_payloads; `public` cannot be a role name in PostgreSQL."""
    result = runner.invoke(app, ["db", "grants", "public"])
    assert result.exit_code == 2
    assert "TO public" not in result.output


# --- 6. salt keyring rotation is not atomic ---------------------------------------------------------


def test_salt_keyring_rotation_that_fails_keeps_the_old_keyring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvguard keys salt-keyring --out F --rotate k2` truncates F in place and then writes it: a
    write that fails (disk full) leaves an empty file, every salt key lost."""
    out = tmp_path / "salt.keys"
    assert runner.invoke(app, ["keys", "salt-keyring", "--out", str(out)]).exit_code == 0
    before = Keyring.load(out)

    def full(_fd: int, _data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvguard.secretfile.os.write", full)
    result = runner.invoke(app, ["keys", "salt-keyring", "--out", str(out), "--rotate", "k2"])
    monkeypatch.undo()
    assert result.exit_code == 2
    assert Keyring.load(out).secret("k1") == before.secret("k1")


# --- 7. kvguard serve: options and exit codes --------------------------------------------------------


def _serve(tmp_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "KVGUARD_MODE": "dev",
        "KVGUARD_DATA_DIR": str(tmp_path / "data"),
        "KVGUARD_DB_URL": f"sqlite:///{tmp_path / 'kvguard.db'}",
    }
    return subprocess.run(
        [KVGUARD, "serve", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_serve_on_a_port_in_use_exits_2(tmp_path: Path) -> None:
    """docs/cli.md: the servers follow the exit-code table (0, 1, 2). A port in use is an
    environment error; `kvguard serve` exited 3 (uvicorn's startup failure)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve(tmp_path, "--port", str(port))
    assert done.returncode == 2, (done.returncode, done.stderr[-300:])


def test_serve_refuses_a_negative_checkpoint_interval(tmp_path: Path) -> None:
    """`--checkpoint-interval -1` was accepted: the checkpoint thread then waits -1 s, i.e. not at
    all, and spins (about 60% of a core while idle)."""
    started = time.monotonic()
    try:
        done = _serve(tmp_path, "--port", "0", "--checkpoint-interval", "-1", timeout=12)
    except subprocess.TimeoutExpired:
        pytest.fail("kvguard serve started with --checkpoint-interval -1")
    assert done.returncode == 2
    assert time.monotonic() - started < 12


# --- 8. an app role on a database its owner has not migrated yet ------------------------------------


@pytest.mark.postgres
def test_app_role_on_an_unmigrated_database_is_told_to_migrate() -> None:
    """docs/operations.md: migrate as the owner once per release; the app role has no DDL. An
    operator who upgrades kvguard and forgets `kvguard db migrate` got only 'cannot open database
    ...: ProgrammingError' from every command (`kvguard serve` too), which names neither the cause
    (schema behind this release) nor the fix."""
    from tests.dbs import migrate_and_grant, pg_roles  # noqa: PLC0415

    with fresh_pg_database("kvg_review") as url, pg_roles(url) as (owner_url, app_url, app_role):
        migrate_and_grant(owner_url, app_role)
        owner = sa.create_engine(owner_url)
        with owner.begin() as conn:  # the database as the previous release left it
            conn.exec_driver_sql(
                "UPDATE control_alembic_version SET version_num = '0005_command_listing_indexes'"
            )
        owner.dispose()
        result = runner.invoke(app, ["keys", "create", "--role", "admin", "--db", app_url])
    assert result.exit_code == 2
    assert "migrate" in result.output, result.output


# --- 9. dashboard sign-out form -------------------------------------------------------------------


def test_dashboard_sign_out_requires_the_form_token(env: ApiEnv) -> None:
    """docs/dashboard.md: 'a per-session token in every form'; the sign-out form carries none and a
    post without one signs the session out."""
    browser = _browser(env)
    page = browser.get("/dashboard/").text
    logout = page[page.index('action="/dashboard/logout"') :]
    assert 'name="csrf_token"' in logout[: logout.index("</form>")]
    r = browser.post("/dashboard/logout", data={}, headers=ORIGIN)
    assert r.status_code == 403


# --- 10. ledger signing-key rotation on the servers -------------------------------------------------


def test_serve_can_sign_with_the_old_and_the_new_key_during_a_rotation(tmp_path: Path) -> None:
    """docs/operations.md (Secrets): 'during rotation configure both keys so checkpoints carry both
    signatures'. `kvguard serve` takes exactly one signing key file (ApiConfig.signing_key_file,
    KVGUARD_SIGNING_KEY_FILE) and has no option for a second, so the documented overlap cannot be
    configured. Here both files are given the way a list of files is given in one environment
    variable (os.pathsep); the server refuses to start ('secret file ... does not exist')."""
    from kvguard.audit.signing import SigningKey  # noqa: PLC0415

    old, new = tmp_path / "old.key", tmp_path / "new.key"
    SigningKey.generate("kvguard.test/ledger").save(old)
    SigningKey.generate("kvguard.test/ledger").save(new)
    Keyring.generate("k1").save(tmp_path / "salt.keys")
    environ = {
        **os.environ,
        "KVGUARD_SALT_KEYRING_FILE": str(tmp_path / "salt.keys"),
        "KVGUARD_SIGNING_KEY_FILE": f"{old}{os.pathsep}{new}",
        "KVGUARD_DB_URL": f"sqlite:///{tmp_path / 'kvguard.db'}",
    }
    db_url = environ["KVGUARD_DB_URL"]
    assert runner.invoke(app, ["db", "migrate", "--db", db_url]).exit_code == 0
    admin = ApiKeys(control_db.open_engine(db_url)).create(Role.ADMIN).api_key
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cmd = [KVGUARD, "serve", "--port", str(port), "--origin", "kvguard.test/ledger"]
    proc = subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-300:]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/audit/checkpoints",
            headers={"Authorization": f"Bearer {admin}"},
            timeout=10,
        )
        assert r.status_code in {200, 201}, r.text
        signatures = [line for line in r.json()["note"].splitlines() if line.startswith("\u2014")]
        assert len(signatures) == 2
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# --- 11. the dashboard's policy history past the API's page size ------------------------------------


def test_dashboard_policy_history_shows_the_newest_versions_past_a_thousand(env: ApiEnv) -> None:
    """docs/dashboard.md: Policies lists every version newest first, each diffed against the
    version before. The views call `policies.policy_history(access)`, whose default is the API's
    first page (the *oldest* 1000 versions): with 1003 versions the page listed 1000..991 as the
    newest, and version 1003 was diffed against version 1000."""
    from kvguard.policy import PolicySet  # noqa: PLC0415

    store = env.services.policies
    policy = PolicySet()
    for n in range(1003):
        store.put(policy, author="t", reason=f"r{n}")
    browser = _browser(env)
    listed = [
        int(v)
        for v in re.findall(
            r'href="/dashboard/policies/(\d+)"', browser.get("/dashboard/policies").text
        )
    ]
    assert listed and max(listed) == 1003, listed[:5]
    detail = browser.get("/dashboard/policies/1003").text
    assert "version 1002" in detail and "version 1000" not in detail


def test_serve_stopped_with_sigterm_exits_0(tmp_path: Path) -> None:
    """`kvguard serve --help` and docs/cli.md: 'Exit 0 when stopped'. SIGTERM (what systemd,
    Docker and Kubernetes send) shut it down gracefully and then killed it with the re-raised
    signal (uvicorn 0.54 re-raises captured signals): exit status 143 / -15."""
    import signal  # noqa: PLC0415

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    environ = {
        **os.environ,
        "KVGUARD_MODE": "dev",
        "KVGUARD_DATA_DIR": str(tmp_path / "data"),
        "KVGUARD_DB_URL": f"sqlite:///{tmp_path / 'kvguard.db'}",
    }
    proc = subprocess.Popen(
        [KVGUARD, "serve", "--port", str(port)],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_verify_refuses_a_deeply_nested_certificate_without_traceback(tmp_path: Path) -> None:
    """`kvguard verify CERT` reads certificates that relying parties receive from others: a deeply
    nested JSON document crashed it with RecursionError (traceback) instead of 'INVALID: ... is
    not a readable JSON document' (kvguard.audit.certificate)."""
    from kvguard.audit.signing import SigningKey  # noqa: PLC0415

    vkey = SigningKey.generate("kvguard.test/ledger").verifier_key()
    path = tmp_path / "cert.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    result = runner.invoke(app, ["verify", str(path), "--key", vkey])
    _no_crash(result)
    assert result.exit_code == 1


@pytest.mark.parametrize("kind", ["--model", "--adapter"])
def test_purge_refuses_a_tenant_with_a_model_or_adapter_selector(tmp_path: Path, kind: str) -> None:
    """`kvguard purge --model M --tenant acme` silently dropped --tenant and queued a purge of
    model M for *every* tenant (exit 0). The API refuses the same request (422: 'model and adapter
    purges apply to every tenant; leave it out'), and the CLI's own usage text says 'give exactly
    one of --tenant, --session (with --tenant), --model, --adapter'."""
    url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    assert runner.invoke(app, ["db", "migrate", "--db", url]).exit_code == 0
    result = runner.invoke(app, ["purge", "--db", url, kind, "m", "--tenant", "acme", "--json"])
    assert result.exit_code == 2, result.output
