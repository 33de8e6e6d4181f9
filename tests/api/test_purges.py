"""Purge jobs through the API, on SQLite and PostgreSQL: who may purge what, validation, status
transitions as engines acknowledge and clear, and what the erasure certificate holds."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kvguard.api.app import create_app
from kvguard.api.auth import Role
from kvguard.api.services import ApiConfig, Services
from kvguard.audit.certificate import verify_certificate
from kvguard.audit.events import EventKind
from kvguard.audit.signing import SigningKey
from kvguard.cli import app as cli_app
from kvguard.zeroize.evidence import VerifyMode
from tests.api.conftest import ApiEnv
from tests.api.purge_support import BLOCK_BYTES, SimEngine, scope


def _purge(env: ApiEnv, who: str, **body: Any) -> Any:
    return env.call(who, "POST", "/v1/purges", json=body)


def _job(env: ApiEnv, job_id: int, who: str = "auditor") -> dict[str, Any]:
    r = env.call(who, "GET", f"/v1/purges/{job_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _actions(env: ApiEnv, name: str) -> list[tuple[str, str]]:
    page = env.services.ledger.query(kinds=[EventKind.ADMIN_ACTION], limit=1000)
    found = [r.event.details for r in page.records if r.event.details["action"] == name]
    return [(str(d["principal"]), str(d["outcome"])) for d in found]


def _vkey(env: ApiEnv) -> str:
    assert env.signing_key is not None
    return env.signing_key.verifier_key()


def test_who_may_purge_what(env: ApiEnv) -> None:
    ok = [
        ("admin", {"kind": "tenant", "value": "globex"}),
        ("admin", {"kind": "model", "value": "tiny-llama"}),
        ("admin", {"kind": "adapter", "value": "lora-7"}),
        ("acme", {"kind": "tenant", "value": "acme"}),
        ("acme", {"kind": "session", "value": "s-1", "tenant_id": "acme"}),
    ]
    for who, body in ok:
        r = _purge(env, who, **body)
        assert r.status_code == 202, (who, body, r.text)
        assert r.json()["status"] == "done" and r.json()["engines_expected"] == 0
    refused = [
        ("acme", {"kind": "tenant", "value": "globex"}, 404),
        ("acme", {"kind": "session", "value": "s-1", "tenant_id": "globex"}, 404),
        ("acme", {"kind": "model", "value": "tiny-llama"}, 403),
        ("acme", {"kind": "adapter", "value": "lora-7"}, 403),
        ("auditor", {"kind": "tenant", "value": "acme"}, 403),
        ("admin", {"kind": "tenant", "value": "initech"}, 404),
        ("admin", {"kind": "session", "value": "s-1", "tenant_id": "initech"}, 404),
    ]
    for who, body, code in refused:
        r = _purge(env, who, **body)
        assert r.status_code == code, (who, body, r.text)
    assert "Globex" not in _purge(env, "acme", kind="tenant", value="globex").text
    outcomes = [o for _, o in _actions(env, "purge.create")]
    assert outcomes[:5] == ["ok"] * 5
    assert (
        outcomes[5:12]
        == ["not_found", "not_found", "denied", "denied", "denied"] + ["not_found"] * 2
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kind": "session", "value": "s-1"}, "body.tenant_id"),
        ({"kind": "user", "value": "x"}, "body.kind"),
        ({"kind": "tenant", "value": ""}, "body.value"),
        ({"kind": "tenant", "value": "a/b"}, "body.value"),
        ({"kind": "model", "value": "m\n"}, "body.value"),
        ({"kind": "model", "value": "m", "tenant_id": "acme"}, "body.tenant_id"),
        ({"kind": "tenant", "value": "acme", "tenant_id": "globex"}, "body.tenant_id"),
        ({"kind": "session", "value": "s", "tenant_id": "bad id"}, "body.tenant_id"),
        ({"kind": "tenant", "value": "acme", "extra": 1}, "body.extra"),
        ({"value": "acme"}, "body.kind"),
    ],
)
def test_invalid_purges_are_refused_naming_the_field(
    env: ApiEnv, body: dict[str, Any], field: str
) -> None:
    r = _purge(env, "admin", **body)
    assert r.status_code == 422, r.text
    assert field in r.json()["message"]
    assert "a/b" not in r.json()["message"]  # the value sent is never echoed
    assert env.services.commands.latest_seq() == 0


def test_status_moves_from_queued_to_running_to_done(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    one, two = SimEngine(env.services, "engine-one"), SimEngine(env.services, "engine-two")
    one.cache(scope("acme"), [0, 1, 2])
    two.cache(scope("acme"), [0, 5])
    two.cache(scope("globex"), [7])
    r = _purge(env, "acme", kind="tenant", value="acme")
    assert r.status_code == 202 and r.json() == {
        "job_id": 1,
        "status": "queued",
        "engines_expected": 2,
    }
    assert _job(env, 1)["status"] == "queued"
    assert one.run_commands() == 1
    job = _job(env, 1, "acme")
    assert job["status"] == "running" and job["blocks_quarantined"] == 3
    states = {e["engine_id"]: e["state"] for e in job["engines"]}
    assert states == {"engine-one": "acknowledged", "engine-two": "pending"}
    two.run_commands()
    assert _job(env, 1)["status"] == "running"  # acknowledged, nothing cleared yet
    assert env.call("auditor", "GET", "/v1/purges/1/certificate").status_code == 409
    assert one.zeroize() == (0, 1, 2)
    job = _job(env, 1)
    assert job["status"] == "running" and job["blocks_cleared"] == 3
    assert two.zeroize() == (0, 5)
    job = _job(env, 1)
    assert job["status"] == "done" and job["certificate"] == "/v1/purges/1/certificate"
    assert (job["blocks_quarantined"], job["blocks_cleared"], job["engines_expected"]) == (5, 5, 2)
    assert {e["state"] for e in job["engines"]} == {"done"}
    r = env.call("acme", "GET", "/v1/purges/1/certificate")
    assert r.status_code == 200, r.text
    report = verify_certificate(r.json(), [_vkey(env)])
    assert (report.job_id, report.blocks_cleared, report.engines) == (1, 5, 2)
    assert [o for _, o in _actions(env, "purge.certificate")] == ["conflict", "ok"]


def test_a_committed_purge_is_answered_202_when_its_status_cannot_be_read(
    make_env: Callable[..., ApiEnv], any_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: the database failing between the purge's commit and the read of its
    status answered 503 "retry later" (a retry queues a second purge) and recorded a `failed`
    purge.create entry next to the committed `ok` one. The job stands: 202 with its id, one
    request entry, and the job runs."""
    import sqlalchemy as sa  # noqa: PLC0415

    from kvguard.api.routes import purges as route  # noqa: PLC0415

    env = make_env(any_db)
    engine = SimEngine(env.services, "engine-one")
    engine.cache(scope("acme"), [0, 1])
    real, calls = route.jobs.job_report, []

    def flaky(access: Any, job_id: int) -> Any:
        calls.append(job_id)
        if len(calls) == 1:
            raise sa.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))
        return real(access, job_id)

    monkeypatch.setattr(route.jobs, "job_report", flaky)
    r = _purge(env, "admin", kind="tenant", value="acme")
    assert r.status_code == 202, r.text
    assert r.json() == {"job_id": 1, "status": "queued", "engines_expected": 1}
    env.services.deliver()
    assert [outcome for _, outcome in _actions(env, "purge.create")] == ["ok"]
    assert engine.run_commands() == 1 and engine.zeroize() == (0, 1)
    assert _job(env, 1)["status"] == "done"


def test_a_job_with_no_live_engine_is_done_with_nothing_to_clear(env: ApiEnv) -> None:
    stale = SimEngine(env.services, "engine-gone")
    env.services.engines.stop(stale.engine_id, time.time() - 60)
    job_id = _purge(env, "admin", kind="model", value="tiny-llama").json()["job_id"]
    job = _job(env, job_id)
    assert (job["status"], job["no_live_engines"], job["engines"]) == ("done", True, [])
    cert = env.call("auditor", "GET", f"/v1/purges/{job_id}/certificate").json()
    assert cert["job"]["no_live_engines"] is True
    assert cert["media"]["kv_cache_blocks"]["quarantined"] == 0
    assert cert["sanitization"]["verification"]["result"] == "nothing_to_clear"
    assert [e["role"] for e in cert["evidence"]["entries"]] == ["request"]
    assert verify_certificate(cert, [_vkey(env)]).engines == 0


def test_an_engine_that_stops_before_finishing_leaves_the_job_incomplete(env: ApiEnv) -> None:
    engine = SimEngine(env.services, "engine-crash")
    engine.cache(scope("acme"), [3])
    job_id = _purge(env, "admin", kind="tenant", value="acme").json()["job_id"]
    engine.run_commands()  # acknowledged, but it never clears the block
    env.services.engines.stop(engine.engine_id, time.time())
    job = _job(env, job_id)
    assert job["status"] == "incomplete" and job["engines"][0]["state"] == "lost"
    r = env.call("admin", "GET", f"/v1/purges/{job_id}/certificate")
    assert r.status_code == 409 and "incomplete" in r.json()["message"]


def test_jobs_list_newest_first_with_a_cursor_and_tenant_scoping(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    made = [
        _purge(env, "admin", kind="tenant", value="acme"),
        _purge(env, "admin", kind="session", value="s-9", tenant_id="globex"),
        _purge(env, "admin", kind="model", value="tiny-llama"),
        _purge(env, "acme", kind="session", value="s-1", tenant_id="acme"),
        _purge(env, "admin", kind="tenant", value="globex"),
    ]
    ids = [r.json()["job_id"] for r in made]
    page = env.call("auditor", "GET", "/v1/purges", params={"limit": 2}).json()
    assert [j["job_id"] for j in page["jobs"]] == ids[::-1][:2] and page["next_before"] == ids[3]
    rest = env.call("auditor", "GET", "/v1/purges", params={"before": ids[3]}).json()
    assert [j["job_id"] for j in rest["jobs"]] == ids[::-1][2:] and rest["next_before"] is None
    own = env.call("acme", "GET", "/v1/purges").json()["jobs"]
    assert [(j["job_id"], j["kind"]) for j in own] == [(ids[3], "session"), (ids[0], "tenant")]
    only = env.call("admin", "GET", "/v1/purges", params={"tenant_id": "globex"}).json()["jobs"]
    assert [j["job_id"] for j in only] == [ids[4], ids[1]]
    assert env.call("acme", "GET", "/v1/purges", params={"tenant_id": "globex"}).status_code == 404
    for hidden in (ids[1], ids[2], ids[4], 999):
        assert env.call("acme", "GET", f"/v1/purges/{hidden}").status_code == 404
        assert env.call("acme", "GET", f"/v1/purges/{hidden}/certificate").status_code == 404
    assert env.call("admin", "GET", "/v1/purges/999").status_code == 404


def test_certificate_content(env: ApiEnv) -> None:
    engine = SimEngine(env.services, "engine-a")
    engine.cache(scope("acme", session="sess-42"), [4, 6])
    engine.cache(scope("acme", session="sess-other"), [8])
    running = engine.hold(scope("acme", session="sess-42"), [9])
    job_id = _purge(env, "acme", kind="session", value="sess-42", tenant_id="acme").json()["job_id"]
    engine.run_commands()
    engine.zeroize(VerifyMode.FULL)
    r = env.call("auditor", "GET", f"/v1/purges/{job_id}/certificate")
    assert r.status_code == 200, r.text
    assert r.headers["content-disposition"] == (
        f'attachment; filename="erasure-certificate-{job_id}.json"'
    )
    cert = r.json()
    assert cert["format"] == "kvguard/erasure-certificate" and cert["version"] == 1
    assert any("800-88" in s for s in cert["standards"]) and any(
        "SC-4" in s for s in cert["standards"]
    )
    assert cert["issuer"]["ledger_origin"] == "kvguard.test/ledger"
    assert cert["requested_by"]["principal"].startswith("key:")
    assert cert["selector"] == {
        "kind": "session",
        "tenant_tag": env.services.deriver.tenant_tag("acme"),
        "value": None,
        "value_disclosed": False,
    }
    (media,) = cert["media"]["engines"]
    assert media["engine_id"] == "engine-a" and media["model"] == "tiny-llama"
    assert (media["blocks_quarantined"], media["blocks_active_deferred"]) == (2, 1)
    assert media["bytes_cleared"] == 2 * BLOCK_BYTES and media["devices"] == ["cpu"]
    assert cert["media"]["kv_cache_blocks"] == {
        "quarantined": 2,
        "cleared": 2,
        "active_deferred": 1,
        "bytes_cleared": 2 * BLOCK_BYTES,
    }
    san = cert["sanitization"]
    assert (san["method_type"], san["technique"]) == ("Clear", ["torch"])
    assert san["verification"] == {"modes": ["full"], "result": "passed"}
    stamps = cert["timestamps"]
    assert stamps["requested"] <= stamps["purged_first"] <= stamps["zeroized_last"]
    assert any("in use by running requests" in n for n in cert["notes"])
    roles = [e["role"] for e in cert["evidence"]["entries"]]
    assert sorted(roles) == ["purge", "request", "zeroize"]
    assert cert["evidence"]["checkpoint"].startswith("kvguard.test/ledger\n")
    # Neither the tenant id nor the session id appears, in the document or in any leaf.
    leaves = b"".join(base64.b64decode(e["leaf"]) for e in cert["evidence"]["entries"])
    for secret in (b"acme", b"sess-42"):
        assert secret not in leaves and secret.decode() not in json.dumps(cert)
    assert "+" not in cert["verify"]["trust"] and _vkey(env) not in json.dumps(cert)
    engine.end(running)  # the doomed block is quarantined on release and cleared like any other
    assert engine.zeroize() == (9,)


def test_each_engine_counts_only_its_own_clears(env: ApiEnv) -> None:
    """Block ids are per engine: engine B clearing its block 0 proves nothing about A's block 0."""
    a, b = SimEngine(env.services, "engine-a"), SimEngine(env.services, "engine-b")
    a.cache(scope("acme"), [0])
    b.cache(scope("acme"), [0])
    job_id = _purge(env, "admin", kind="tenant", value="acme").json()["job_id"]
    a.run_commands()
    b.run_commands()
    b.zeroize()
    states = {e["engine_id"]: e["state"] for e in _job(env, job_id)["engines"]}
    assert states == {"engine-a": "acknowledged", "engine-b": "done"}
    a.handover_clear([0])  # a handover clear is about the block's next owner: not evidence
    assert _job(env, job_id)["status"] == "running"
    a.zeroize()
    assert _job(env, job_id)["status"] == "done"


def test_engines_without_engine_ids_share_one_id_space(env: ApiEnv) -> None:
    a = SimEngine(env.services, "engine-a", names=False)
    b = SimEngine(env.services, "engine-b", names=False)
    a.cache(scope("globex", adapter="lora-7"), [2])
    b.cache(scope("globex", adapter="lora-7"), [2])
    job_id = _purge(env, "admin", kind="adapter", value="lora-7").json()["job_id"]
    a.run_commands()
    b.run_commands()
    b.zeroize()  # without engine ids, B's clear of block 2 covers both purge entries
    job = _job(env, job_id)
    assert job["status"] == "done" and job["blocks_cleared"] == 2
    cert = env.call("admin", "GET", f"/v1/purges/{job_id}/certificate").json()
    assert cert["selector"]["value"] == "lora-7"
    assert [e["bytes_cleared"] for e in cert["media"]["engines"]] == [None, None]
    assert verify_certificate(cert, [_vkey(env)]).blocks_cleared == 2


def _api_on(files: dict[str, Any], tenant: str) -> tuple[Services, TestClient, dict[str, str]]:
    """The API on the engine's database, keyring and signing key, with `tenant` and an admin."""
    config = ApiConfig(
        db_url=files["ledger_url"],
        signing_key_file=files["signing_key_file"],
        salt_keyring_file=files["salt_keyring_file"],
        origin=files["ledger_origin"],
        checkpoint_interval_s=None,
    )
    services = Services.open(config)
    services.tenants.create(tenant, display_name=tenant, created_by="test")
    headers = {"Authorization": f"Bearer {services.keys.create(Role.ADMIN).api_key}"}
    return services, TestClient(create_app(services)), headers


def _until_done(llm: Any, client: TestClient, headers: dict[str, str], job_id: int) -> Any:
    job: dict[str, Any] = {}
    for _ in range(20):
        time.sleep(0.6)  # the engine polls commands at most once a second
        llm.sync()
        job = client.get(f"/v1/purges/{job_id}", headers=headers).json()
        if job["status"] == "done":
            break
    return job


@pytest.mark.vllm
@pytest.mark.slow
def test_purge_on_a_real_engine_certificate_verifies_offline(guarded: Any, tmp_path: Path) -> None:
    """The whole path: the session's governed in-process vLLM engine and the API on one SQLite
    database; a tenant purge through the API, executed by the engine from the command table, cleared
    on its KV cache, and the certificate verified by `kvguard verify` with the ledger's key."""
    from vllm import SamplingParams  # noqa: PLC0415

    from tests.engine_adapter.vllm_support import BLOCK  # noqa: PLC0415

    llm, tenant = guarded, "e2e-purged"
    files = {
        "ledger_url": llm.options.ledger_url,
        "signing_key_file": llm.options.signing_key_file,
        "salt_keyring_file": llm.options.salt_keyring_file,
        "ledger_origin": llm.options.ledger_origin,
    }
    services, client, headers = _api_on(files, tenant)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        docs = [[(31 * d + 7 * i) % 500 + 5 for i in range(2 * BLOCK)] for d in range(3)]
        llm.generate(docs[:2], params, tenant=tenant)
        llm.generate(docs[2:], params, tenant="e2e-kept")
        r = client.post("/v1/purges", json={"kind": "tenant", "value": tenant}, headers=headers)
        assert r.status_code == 202 and r.json()["engines_expected"] == 1, r.text
        job = _until_done(llm, client, headers, r.json()["job_id"])
        assert job["status"] == "done", job
        assert job["blocks_quarantined"] == job["blocks_cleared"] >= 4  # two 2-block prompts
        cert = client.get(f"/v1/purges/{job['job_id']}/certificate", headers=headers)
        assert cert.status_code == 200, cert.text
        body = cert.json()
        assert body["selector"]["tenant_tag"] == services.deriver.tenant_tag(tenant)
        assert body["sanitization"]["technique"] == ["torch"]  # the CPU executor
        assert body["sanitization"]["verification"]["result"] == "passed"
        path = tmp_path / "certificate.json"
        path.write_bytes(cert.content)
        vkey = SigningKey.load(llm.options.signing_key_file).verifier_key()
        result = CliRunner().invoke(cli_app, ["verify", str(path), "--key", vkey])
        assert result.exit_code == 0, result.output
        cleared = f"purge job {job['job_id']}: {job['blocks_cleared']} blocks cleared on 1 engine,"
        assert cleared in result.output
    finally:
        client.close()
        services.close()


def test_a_purge_larger_than_one_ledger_entry_is_split_and_still_certified(env: ApiEnv) -> None:
    """An event names at most 4,096 blocks: a 9,000-block purge and its clear become several
    entries each, and the certificate still covers every block."""
    blocks = 9_000
    engine = SimEngine(env.services, "engine-big", num_blocks=blocks)
    engine.cache(scope("acme"), list(range(blocks)))
    job_id = _purge(env, "admin", kind="tenant", value="acme").json()["job_id"]
    engine.run_commands()
    assert len(engine.zeroize()) == blocks
    assert _job(env, job_id)["status"] == "done"
    cert = env.call("auditor", "GET", f"/v1/purges/{job_id}/certificate").json()
    roles = [e["role"] for e in cert["evidence"]["entries"]]
    assert roles.count("purge") == 3 and roles.count("zeroize") == 3
    assert cert["media"]["kv_cache_blocks"]["quarantined"] == blocks
    assert cert["media"]["kv_cache_blocks"]["cleared"] == blocks
    assert cert["media"]["kv_cache_blocks"]["bytes_cleared"] == blocks * BLOCK_BYTES
    verify_certificate(cert, [_vkey(env)])


def test_a_slow_evidence_read_does_not_make_a_live_engine_lost(
    make_env: Callable[..., ApiEnv], any_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine is live by its heartbeat as of the registry read, not as of after the ledger's
    evidence is read (found by a review: an 11 s evidence read turned a live engine `lost` and its
    queued job `incomplete`, in the report and in a purge's 202 answer)."""
    from kvguard.api import purge_jobs  # noqa: PLC0415

    env = make_env(any_db)
    offset = [0.0]
    object.__setattr__(env.services, "clock", lambda: time.time() + offset[0])
    engine = SimEngine(env.services, "engine-one")
    engine.cache(scope("acme", "s-1"), [1, 2])
    r = _purge(env, "acme", kind="session", value="s-1", tenant_id="acme")
    assert r.status_code == 202, r.text
    job = int(r.json()["job_id"])
    assert _job(env, job)["status"] == "queued"
    real = purge_jobs.find_evidence

    def slow(ledger: Any, windows: Any) -> Any:  # 11 s pass while the evidence is read
        found = real(ledger, windows)
        offset[0] += 11
        env.services.engines.touch("engine-one", time.time() + offset[0] - 1)
        return found

    monkeypatch.setattr(purge_jobs, "find_evidence", slow)
    got = _job(env, job)
    assert got["status"] == "queued", got
    assert [e["state"] for e in got["engines"]] == ["pending"]
