"""Erasure certificates say only what the ledger backs, whoever queued the purge: `kvguard purge`'s
jobs certify like the API's; a model or adapter name, and the number of engines a tenant disable
waited for, are in the request entry, so a certificate cannot be relabelled or leave an engine
out; engines that record no `engine_id` are counted per purge, not per entry of a split purge; a
failed clear never stands for a block's clear; and `true` is not the integer 1."""

from __future__ import annotations

import base64
import copy
import json
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from kvguard.audit.certificate import verify_certificate
from kvguard.audit.events import AuditEvent
from kvguard.cli import app
from kvguard.control.commands import PurgeCommand, PurgeKind, PurgeSelector
from kvguard.control.outbox import admin_action_event
from kvguard.control.publish import submit_purge
from kvguard.errors import VerificationError
from tests.api.conftest import ApiEnv
from tests.api.purge_support import MODEL, SimEngine, evidence, scope, without_engine

Cert = dict[str, Any]


def _vkey(env: ApiEnv) -> str:
    assert env.signing_key is not None
    return env.signing_key.verifier_key()


def _certificate(env: ApiEnv, job_id: int, who: str = "admin") -> Cert:
    r = env.call(who, "GET", f"/v1/purges/{job_id}/certificate")
    assert r.status_code == 200, r.text
    cert: Cert = r.json()
    return cert


def _refused(env: ApiEnv, job_id: int, reason: str) -> None:
    """The job is done, but its certificate would not verify: 409 with the verifier's reason."""
    assert env.call("admin", "GET", f"/v1/purges/{job_id}").json()["status"] == "done"
    r = env.call("admin", "GET", f"/v1/purges/{job_id}/certificate")
    assert r.status_code == 409, r.text
    assert "does not verify" in r.json()["message"] and reason in r.json()["message"]


def _leaf(entry: dict[str, Any]) -> dict[str, Any]:
    leaf: dict[str, Any] = json.loads(base64.b64decode(entry["leaf"]))
    return leaf


# --- `kvguard purge` ------------------------------------------------------------------------


# No salt key from the environment the tests run in: each test says which keyring the CLI has.
_NO_KEYRING = {"KVGUARD_SALT_KEYRING_FILE": None, "KVGUARD_SALT_KEY": None, "KVGUARD_MODE": None}


def _cli_purge(env: ApiEnv, *args: str) -> int:
    """Run `kvguard purge ARGS --by ops --json` on the env's database with the API's salt keyring,
    and deliver its entry; returns the job id."""
    config = env.services.config
    variables = {**_NO_KEYRING, "KVGUARD_SALT_KEYRING_FILE": str(config.salt_keyring_file)}
    result = CliRunner().invoke(
        app, ["purge", "--db", config.db_url, *args, "--by", "ops", "--json"], env=variables
    )
    assert result.exit_code == 0, result.output
    assert env.services.deliver()
    job_id: int = json.loads(result.stdout)["command_id"]
    return job_id


@pytest.mark.parametrize(
    "args",
    [["--tenant", "acme"], ["--tenant", "acme", "--session", "s-1"], ["--model", "tiny-llama"]],
)
def test_certificate_of_a_cli_purge_verifies(env: ApiEnv, args: list[str]) -> None:
    """The CLI's entry named `cli:ops` while the job said `ops` ("requested by someone else"), had
    no tenant tag ("about another tenant") and no engine count: no CLI purge ever certified."""
    engine = SimEngine(env.services, "engine-a")
    engine.cache(scope("acme", session="s-1"), [1, 2])
    job_id = _cli_purge(env, *args)
    engine.run_commands()
    engine.zeroize()
    job = env.call("admin", "GET", f"/v1/purges/{job_id}").json()
    assert job["status"] == "done" and job["requested_by"] == "cli:ops", job
    cert = _certificate(env, job_id)
    assert verify_certificate(cert, [_vkey(env)]).blocks_cleared == 2
    assert cert["requested_by"]["principal"] == "cli:ops"
    assert cert["job"]["engines_expected"] == 1
    (request,) = [_leaf(e) for e in cert["evidence"]["entries"] if e["role"] == "request"]
    assert "acme" not in json.dumps(request) and "s-1" not in json.dumps(request)  # G6


def test_a_cli_purge_without_the_salt_keyring_warns_that_it_will_not_certify(
    env: ApiEnv,
) -> None:
    """Without the keyring the CLI cannot name the tenant's tag: the purge still runs, the CLI
    says its certificate will not verify, and the API does not serve one that would fail."""
    engine = SimEngine(env.services, "engine-a")
    engine.cache(scope("acme"), [1])
    config = env.services.config
    args = ["purge", "--db", config.db_url, "--tenant", "acme"]
    result = CliRunner().invoke(app, args, env=_NO_KEYRING)
    assert result.exit_code == 0, result.output
    assert "no erasure certificate of it will verify" in result.stderr
    assert env.services.deliver()
    engine.run_commands()
    engine.zeroize()
    (job,) = env.call("admin", "GET", "/v1/purges").json()["jobs"]
    _refused(env, job["job_id"], "about another tenant")


# --- model and adapter names ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "value", "adapter", "other"),
    [("model", "tiny-llama", None, "llama-3-70b-prod"), ("adapter", "lora-7", "lora-7", "lora-x")],
)
def test_model_or_adapter_purge_value_is_backed_by_the_ledger(
    env: ApiEnv, kind: str, value: str, adapter: str | None, other: str
) -> None:
    """The value was in no leaf and only checked to be a string: a certificate could be relabelled
    as the purge of another model or adapter and still verify."""
    engine = SimEngine(env.services, "engine-a")
    engine.cache(scope("acme", adapter=adapter), [1, 2])
    body = {"kind": kind, "value": value}
    job_id = env.call("admin", "POST", "/v1/purges", json=body).json()["job_id"]
    engine.run_commands()
    engine.zeroize()
    cert = _certificate(env, job_id)
    assert verify_certificate(cert, [_vkey(env)]).blocks_cleared == 2
    bad = copy.deepcopy(cert)
    bad["selector"]["value"] = other
    with pytest.raises(VerificationError, match="not the value the request entry records"):
        verify_certificate(bad, [_vkey(env)])


@pytest.mark.parametrize(
    ("selector", "recorded", "message"),
    [
        (PurgeSelector(PurgeKind.MODEL, "tiny-llama"), {"engines_expected": 1}, "not recorded"),
        (PurgeSelector(PurgeKind.TENANT, "acme"), {}, "does not record engines_expected"),
    ],
)
def test_a_request_entry_written_before_the_ledger_backed_these_claims_fails_closed(
    env: ApiEnv, selector: PurgeSelector, recorded: dict[str, int], message: str
) -> None:
    """Entries stored by earlier releases lack the value digest or the engine count: their
    certificates are refused (409) with the verifier's message, which says what the ledger does
    not hold."""
    engine = SimEngine(env.services, "engine-a")
    engine.cache(scope("acme"), [1, 2])
    tag = env.services.deriver.tenant_tag("acme") if selector.kind is PurgeKind.TENANT else None

    def old_entry(job_id: int) -> list[AuditEvent]:
        details = {"job_id": job_id, "purge_kind": selector.kind.value, **recorded}
        return [
            admin_action_event(
                "key:old",
                "admin",
                "purge.create",
                "ok",
                ts=datetime.now(UTC),
                scope_tag=tag,
                details=details,
            )
        ]

    services = env.services
    job_id = submit_purge(
        services.commands, services.outbox, selector, requested_by="key:old", events=old_entry
    )
    assert services.deliver()
    engine.run_commands()
    engine.zeroize()
    _refused(env, job_id, message)


# --- tenant.disable -----------------------------------------------------------------------


def test_tenant_disable_certificate_cannot_drop_an_engine(env: ApiEnv) -> None:
    """`tenant.disable` recorded no engine count, so only "claimed <= listed" was checked: a
    certificate without one engine's entries and figures verified."""
    engines = [SimEngine(env.services, "engine-a"), SimEngine(env.services, "engine-b")]
    engines[0].cache(scope("acme"), [1, 2, 3])
    engines[1].cache(scope("acme"), [1])
    r = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "offboarded"})
    assert r.status_code == 200, r.text
    job_id = r.json()["purge_job_id"]
    for e in engines:
        e.run_commands()
        e.zeroize()
    cert = _certificate(env, job_id)
    assert verify_certificate(cert, [_vkey(env)]).engines == 2
    assert cert["job"]["engines_expected"] == 2
    bad = without_engine(cert, "engine-b")
    bad["job"]["engines_expected"] = 1
    with pytest.raises(VerificationError, match="fewer engines than were live"):
        verify_certificate(bad, [_vkey(env)])


# --- engines without engine_id, split purge entries --------------------------------------


def _big(env: ApiEnv, engine_id: str, n: int, *, names: bool) -> SimEngine:
    """An engine caching `n` blocks of acme's: over 4,096, its purge entry is split into parts."""
    e = SimEngine(env.services, engine_id, num_blocks=n + 8, names=names)
    e.cache(scope("acme"), list(range(n)))
    return e


def test_an_old_engine_whose_purge_entry_is_split_certifies(env: ApiEnv) -> None:
    """One engine without `engine_id` and a split purge entry counted as two engines: its
    certificate failed with "an engine without a purge entry, or one missing"."""
    a = _big(env, "engine-a", 4097, names=False)
    body = {"kind": "tenant", "value": "acme"}
    job_id = env.call("acme", "POST", "/v1/purges", json=body).json()["job_id"]
    a.run_commands()
    a.zeroize()
    cert = _certificate(env, job_id, "acme")
    assert len([e for e in cert["evidence"]["entries"] if e["role"] == "purge"]) == 2
    assert verify_certificate(cert, [_vkey(env)]).blocks_cleared == 4097


@pytest.mark.parametrize("b_names", [False, True])
def test_no_certificate_while_an_acknowledged_engine_has_no_purge_entry(
    env: ApiEnv, b_names: bool
) -> None:
    """Engine A's two parts stood for engine B, whose purge entry never reached the ledger: the
    job was `done` and its certificate verified."""
    a = _big(env, "engine-a", 4097, names=False)
    b = SimEngine(env.services, "engine-b", names=b_names)
    b.cache(scope("acme"), [1, 2])
    body = {"kind": "tenant", "value": "acme"}
    job_id = env.call("acme", "POST", "/v1/purges", json=body).json()["job_id"]
    a.run_commands()
    a.zeroize()
    (cmd,) = [
        c
        for c in env.services.commands.pending_after(b.last_command)
        if isinstance(c, PurgeCommand)
    ]
    b.last_command = cmd.seq
    details = {"command_id": cmd.id, **({"engine_id": "engine-b"} if b_names else {})}
    assert len(b.custody.purge(cmd.selector, time.time(), details=details)) == 2
    assert b.custody.take_events()  # held back: never reaches the ledger
    result = {"blocks_quarantined": 2, "blocks_active_doomed": 0}
    env.services.commands.acknowledge(cmd.id, "engine-b", result)
    job = env.call("acme", "GET", f"/v1/purges/{job_id}").json()
    assert job["status"] == "running", job
    (progress,) = [e for e in job["engines"] if e["engine_id"] == "engine-b"]
    assert progress["missing"] == ["purge entry in the ledger"]
    assert env.call("acme", "GET", f"/v1/purges/{job_id}/certificate").status_code == 409


# --- a failed clear before the real one ----------------------------------------------------


def test_a_failed_clear_in_the_ledger_before_the_real_one(env: ApiEnv) -> None:
    """A canonical `block.zeroize` entry with `verified: false` naming the purge's blocks, appended
    before the real clear, covered them: the job was `done` and its certificate answered 400."""
    e = SimEngine(env.services, "engine-a")
    e.cache(scope("acme"), [1, 2])
    body = {"kind": "tenant", "value": "acme"}
    job_id = env.call("acme", "POST", "/v1/purges", json=body).json()["job_id"]
    e.run_commands()
    failed = {**evidence(2), "engine_id": "engine-a", "verified": False, "handover": False}
    event = {"kind": "block.zeroize", "scope_tag": None, "request_id": None, "block_ids": [1, 2]}
    env.services.ledger.append(
        AuditEvent.model_validate({**event, "details": failed, "ts": datetime.now(UTC)})
    )
    env.services.ledger.flush()
    job = env.call("acme", "GET", f"/v1/purges/{job_id}").json()
    assert job["status"] == "running", job  # the failed clear covers nothing
    e.zeroize()
    assert env.call("acme", "GET", f"/v1/purges/{job_id}").json()["status"] == "done"
    cert = _certificate(env, job_id, "acme")
    verify_certificate(cert, [_vkey(env)])
    assert cert["sanitization"]["verification"]["result"] == "passed"


# --- JSON types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "version",
        "media.engines.0.blocks_quarantined",
        "media.kv_cache_blocks.quarantined",
        "job.engines_expected",
    ],
)
def test_true_is_not_the_integer_one(env: ApiEnv, path: str) -> None:
    """Python's `True == 1` let `"version": true`, or a count of `true`, pass for 1."""
    engine = SimEngine(env.services, "engine-a")
    engine.cache(scope("acme"), [1])
    body = {"kind": "tenant", "value": "acme"}
    job_id = env.call("acme", "POST", "/v1/purges", json=body).json()["job_id"]
    engine.run_commands()
    engine.zeroize()
    cert = _certificate(env, job_id, "acme")
    verify_certificate(cert, [_vkey(env)])
    bad = copy.deepcopy(cert)
    *parents, last = path.split(".")
    node: Any = bad
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    assert node[last] == 1
    node[last] = True
    with pytest.raises(VerificationError):
        verify_certificate(bad, [_vkey(env)])


# --- the engines a job waits for are counted at the instant it is dated ---------------------------


def _hold_row_lock(url: str, table: str, seconds: float) -> threading.Thread:
    """Another writer holds `table`'s row lock for `seconds` (as a slow concurrent write does)."""
    started = threading.Event()

    def hold() -> None:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"SELECT * FROM {table} FOR UPDATE")
            started.set()
            time.sleep(seconds)
        engine.dispose()

    thread = threading.Thread(target=hold)
    thread.start()
    assert started.wait(10)
    return thread


def _never_done_with_a_bad_certificate(env: ApiEnv, job_id: int) -> None:
    job = env.call("admin", "GET", f"/v1/purges/{job_id}").json()
    if job["status"] == "done":
        verify_certificate(_certificate(env, job_id), [_vkey(env)])


@pytest.mark.postgres
def test_a_disable_waiting_for_its_locks_dates_its_job_when_it_counted_the_engines(
    make_env: Any, pg_db: str
) -> None:
    """The disable counted two live engines, then waited for the policy head; one engine stopped
    meanwhile. The job, dated after the wait, waited for one engine, went `done`, and its
    certificate listed fewer engines than its request entry recorded: served with 200, refused
    offline. Dated when the engines were counted, it waits for both."""
    env = make_env(pg_db)
    a, b = SimEngine(env.services, "engine-a"), SimEngine(env.services, "engine-b")
    a.cache(scope("acme"), [1, 2])
    holder = _hold_row_lock(pg_db, "policy_head", 2.0)
    answer: dict[str, Any] = {}
    disable = threading.Thread(
        target=lambda: answer.setdefault(
            "r", env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "x"})
        )
    )
    disable.start()
    time.sleep(0.5)  # it has counted the engines and waits for the policy head
    env.services.engines.stop(b.engine_id, time.time())
    holder.join()
    disable.join()
    job_id = answer["r"].json()["purge_job_id"]
    a.run_commands()
    a.zeroize()
    _never_done_with_a_bad_certificate(env, job_id)


@pytest.mark.postgres
def test_a_cli_purge_waiting_for_the_command_head_dates_its_job_when_it_counted_the_engines(
    make_env: Any, pg_db: str
) -> None:
    env = make_env(pg_db)
    a = SimEngine(env.services, "engine-a")
    a.cache(scope("acme"), [1, 2])
    # engine-b's last heartbeat is 9 s old: live when counted, past the 10 s age after the wait
    env.services.engines.register(
        "engine-b", model=MODEL, block_size=16, num_blocks=16, now=time.time() - 9.0
    )
    holder = _hold_row_lock(pg_db, "command_head", 2.5)
    job_id = _cli_purge(env, "--tenant", "acme")
    holder.join()
    a.run_commands()
    a.zeroize()
    _never_done_with_a_bad_certificate(env, job_id)


def test_a_certificate_that_would_fail_offline_is_never_served(
    env: ApiEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API verifies a certificate as an auditor would before it serves it: a done job whose
    certificate does not verify (an inconsistency like the one above) gets 409, never 200."""
    from kvguard.api import certificates  # noqa: PLC0415

    engine = SimEngine(env.services, "engine-a")
    engine.cache(scope("acme"), [1, 2])
    job_id = env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    job_id = job_id.json()["job_id"]
    engine.run_commands()
    engine.zeroize()
    verify_certificate(_certificate(env, job_id), [_vkey(env)])  # served, and it verifies
    issue = certificates.issue

    def inconsistent(services: Any, report: Any) -> dict[str, Any]:
        document = issue(services, report)
        document["job"]["engines_expected"] = 0  # not what the request entry recorded
        return document

    monkeypatch.setattr(certificates, "issue", inconsistent)
    r = env.call("admin", "GET", f"/v1/purges/{job_id}/certificate")
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "conflict" and "does not verify" in r.json()["message"]
