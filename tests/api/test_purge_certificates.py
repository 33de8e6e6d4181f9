"""Erasure certificates verify offline (`kvguard verify CERT.json --key VKEY`) and every tampering is
caught: a flipped leaf byte, a dropped or foreign entry, a changed count, another key."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvguard.audit import erasure
from kvguard.audit.certificate import verify_certificate
from kvguard.audit.cli import verify_command
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError
from tests.api.conftest import ApiEnv
from tests.api.purge_support import SimEngine, scope, without_engine

Cert = dict[str, Any]


@pytest.fixture
def issued(env: ApiEnv) -> tuple[ApiEnv, Cert, str]:
    """A done tenant purge on two engines and its certificate, with the trusted verifier key."""
    engines = [SimEngine(env.services, "engine-a"), SimEngine(env.services, "engine-b")]
    engines[0].cache(scope("acme"), [1, 2, 3])
    engines[1].cache(scope("acme"), [1])
    engines[1].cache(scope("globex"), [4])
    job_id = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    job_id = job_id.json()["job_id"]
    for e in engines:
        e.run_commands()
        e.zeroize()
    r = env.call("acme", "GET", f"/v1/purges/{job_id}/certificate")
    assert r.status_code == 200, r.text
    assert env.signing_key is not None
    return env, r.json(), env.signing_key.verifier_key()


def _cli(path: Path, *keys: str, extra: tuple[str, ...] = ()) -> tuple[int, str]:
    app = typer.Typer()
    app.command()(verify_command)
    args = [str(path), *[a for k in keys for a in ("--key", k)], *extra]
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.output


def _write(tmp_path: Path, cert: Cert) -> Path:
    path = tmp_path / "cert.json"
    path.write_text(json.dumps(cert, indent=2))
    return path


def _entries(cert: Cert, role: str) -> list[dict[str, Any]]:
    return [e for e in cert["evidence"]["entries"] if e["role"] == role]


def test_certificate_verifies_on_the_command_line(
    issued: tuple[ApiEnv, Cert, str], tmp_path: Path
) -> None:
    _env, cert, vkey = issued
    code, out = _cli(_write(tmp_path, cert), vkey)
    assert code == 0, out
    assert "valid: erasure certificate of purge job 1: 4 blocks cleared on 2 engines" in out
    assert _cli(_write(tmp_path, cert), vkey, extra=("--origin", "kvguard.test/ledger"))[0] == 0
    code, out = _cli(_write(tmp_path, cert), vkey, extra=("--origin", "other.example/log"))
    assert code == 1 and "origin" in out


def test_another_key_or_a_bad_key_or_a_bad_call(
    issued: tuple[ApiEnv, Cert, str], tmp_path: Path
) -> None:
    _env, cert, _vkey = issued
    path = _write(tmp_path, cert)
    stranger = SigningKey.generate("kvguard.test/ledger").verifier_key()
    code, out = _cli(path, stranger)
    assert code == 1 and "not signed by any trusted key" in out
    assert _cli(path, "not-a-key")[0] == 2
    assert _cli(path, _vkey, extra=("--full",))[0] == 2
    assert _cli(tmp_path / "missing.json", _vkey)[0] == 2
    (tmp_path / "junk.json").write_text("{not json")
    assert _cli(tmp_path / "junk.json", _vkey)[0] == 1


def _flip_leaf_byte(cert: Cert) -> None:
    entry = _entries(cert, "zeroize")[0]
    leaf = bytearray(base64.b64decode(entry["leaf"]))
    leaf[len(leaf) // 2] ^= 0x01
    entry["leaf"] = base64.b64encode(bytes(leaf)).decode()


def _drop(role: str) -> Callable[[Cert], None]:
    def change(cert: Cert) -> None:
        cert["evidence"]["entries"].remove(_entries(cert, role)[0])

    return change


def _set(path: str, value: Any) -> Callable[[Cert], None]:
    def change(cert: Cert) -> None:
        *parents, last = path.split(".")
        node: Any = cert
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value

    return change


def _bad_proof_hash(cert: Cert) -> None:
    proof = _entries(cert, "purge")[0]["inclusion_proof"]
    proof[0] = base64.b64encode(bytes(32)).decode()


TAMPERING: dict[str, tuple[Callable[[Cert], None], str]] = {
    "leaf byte flipped": (_flip_leaf_byte, "inclusion|does not"),
    "zeroize entry dropped": (_drop("zeroize"), "no zeroize entry"),
    "purge entry dropped": (_drop("purge"), "covers no purged block"),
    "total count changed": (_set("media.kv_cache_blocks.quarantined", 3), "quarantined"),
    "cleared count changed": (_set("media.kv_cache_blocks.cleared", 5), "cleared"),
    "bytes changed": (_set("media.kv_cache_blocks.bytes_cleared", 1), "bytes_cleared"),
    "engine count changed": (_set("media.engines.0.blocks_quarantined", 2), "blocks_quarantined"),
    "engine removed": (lambda c: c["media"]["engines"].pop(), "is not listed|fewer engines"),
    "technique changed": (_set("sanitization.technique", ["triton"]), "technique"),
    "result changed": (_set("sanitization.verification.result", "passed-ish"), "result"),
    "time changed": (_set("timestamps.zeroized_last", "2099-01-01T00:00:00.000000Z"), "zeroized"),
    "job changed": (_set("job.job_id", 2), "another job"),
    "kind changed": (_set("selector.kind", "session"), "another job or kind"),
    "tenant changed": (_set("selector.tenant_tag", "tt_AAAAAAAAAAAAAAAAAAAAAA"), "another tenant"),
    "requester changed": (_set("requested_by.principal", "key:someone"), "someone else"),
    "proof hash changed": (_bad_proof_hash, "inclusion|root"),
    "origin changed": (_set("issuer.ledger_origin", "evil.example/log"), "origin"),
    "format changed": (_set("version", 2), "version-1"),
}


@pytest.mark.parametrize("name", list(TAMPERING))
def test_tampering_is_caught(issued: tuple[ApiEnv, Cert, str], tmp_path: Path, name: str) -> None:
    _env, cert, vkey = issued
    change, message = TAMPERING[name]
    bad = copy.deepcopy(cert)
    change(bad)
    with pytest.raises(VerificationError, match=message):
        verify_certificate(bad, [vkey])
    code, out = _cli(_write(tmp_path, bad), vkey)
    assert code == 1 and out.startswith("INVALID:"), out


def test_certificate_result_as_json(issued: tuple[ApiEnv, Cert, str], tmp_path: Path) -> None:
    """`--json`: one object on stdout, for a valid certificate and for a tampered one (exit 1)."""
    _env, cert, vkey = issued
    app = typer.Typer()
    app.command()(verify_command)
    result = CliRunner().invoke(app, [str(_write(tmp_path, cert)), "--key", vkey, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["valid"], report["kind"], report["job_id"]) == (True, "certificate", 1)
    assert (report["blocks_cleared"], report["engines"], report["cosigned_by"]) == (4, 2, [])
    assert {"origin", "tree_size", "entries", "saved_checkpoint"} <= set(report)
    bad = copy.deepcopy(cert)
    _set("media.kv_cache_blocks.cleared", 5)(bad)
    result = CliRunner().invoke(app, [str(_write(tmp_path, bad)), "--key", vkey, "--json"])
    assert result.exit_code == 1, result.output
    failed = json.loads(result.stdout)
    assert (failed["valid"], failed["kind"], failed["exit_code"]) == (False, "certificate", 1)
    assert "cleared" in failed["error"] and result.stderr.startswith("INVALID:")


def test_a_whole_engine_left_out_is_caught_by_the_request_entry(
    issued: tuple[ApiEnv, Cert, str],
) -> None:
    _env, cert, vkey = issued
    bad = without_engine(cert, "engine-b")
    with pytest.raises(VerificationError, match="fewer engines than were live"):
        verify_certificate(bad, [vkey])
    # Every job has its request entry (`purge.create`): a certificate without it is refused too,
    # so dropping it cannot hide the missing engine.
    bad["evidence"]["entries"] = [e for e in bad["evidence"]["entries"] if e["role"] != "request"]
    with pytest.raises(VerificationError):
        verify_certificate(bad, [vkey])


def _foreign_entry(env: ApiEnv, cert: Cert, kind: str) -> dict[str, Any]:
    """A genuine entry of the same log (with a proof against the certificate's checkpoint) that is
    not part of this job's evidence."""
    size = cert["evidence"]["tree_size"]
    used = {e["index"] for e in cert["evidence"]["entries"]}
    page = env.services.ledger.query(kinds=[kind], limit=100)
    record = next(r for r in page.records if r.index not in used and r.index < size)
    proof = env.services.ledger.inclusion_proof(record.index, size)
    return {
        "role": "zeroize" if kind == "block.zeroize" else "purge",
        "index": record.index,
        "leaf": base64.b64encode(record.leaf).decode(),
        "inclusion_proof": [base64.b64encode(h).decode() for h in proof],
    }


def test_genuine_entries_that_prove_nothing_are_refused(issued: tuple[ApiEnv, Cert, str]) -> None:
    env, _cert, vkey = issued
    other = SimEngine(env.services, "engine-c")
    other.cache(scope("globex"), [6])
    env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "globex"})
    other.run_commands()
    other.zeroize()
    env.services.ledger.checkpoint()
    fresh = env.call("acme", "GET", "/v1/purges/1/certificate").json()
    verify_certificate(fresh, [vkey])  # the same job, proven against the newer checkpoint
    for kind, message in (
        ("block.zeroize", "covers no purged block"),
        ("tenant.purge", "another job"),
    ):
        bad = copy.deepcopy(fresh)
        bad["evidence"]["entries"].append(_foreign_entry(env, fresh, kind))
        with pytest.raises(VerificationError, match=message):
            verify_certificate(bad, [vkey])


def test_certificate_verifier_imports_only_cryptography_and_stdlib() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import kvguard.audit.certificate\n"
        "mods = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(' '.join(sorted(m for m in mods if m not in sys.stdlib_module_names)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    third_party = set(out.stdout.split())
    assert third_party <= {"kvguard", "cryptography", "_openssl", "_cffi_backend"}, third_party


# --- offloaded copies: key.shred evidence (issue 15) ------------------------------------------------


def _job(env: ApiEnv, job_id: int) -> dict[str, Any]:
    r = env.call("admin", "GET", f"/v1/purges/{job_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _engine(job: dict[str, Any], engine_id: str) -> dict[str, Any]:
    return next(e for e in job["engines"] if e["engine_id"] == engine_id)


@pytest.fixture
def issued_offload(env: ApiEnv) -> tuple[ApiEnv, Cert, str]:
    """A tenant purge on an engine whose offload tier held two of the tenant's domains (and one of
    another tenant) and on an engine without a tier; the job is done only once the tier engine's
    worker has recorded a `key.shred` entry for each of the two keys."""
    tiered = SimEngine(env.services, "engine-a", tier=True)
    plain = SimEngine(env.services, "engine-b")
    tiered.cache(scope("acme"), [1, 2])
    tiered.spill(scope("acme"), 3, 3 * 4096)
    tiered.spill(scope("acme", session="chat-1"), 2, 2 * 4096)
    tiered.spill(scope("globex"), 1, 4096)
    plain.cache(scope("acme"), [5])
    job_id = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    job_id = job_id.json()["job_id"]
    for e in (tiered, plain):
        e.run_commands()
        e.zeroize()
    job = _job(env, job_id)
    assert job["status"] == "running"
    a, b = _engine(job, "engine-a"), _engine(job, "engine-b")
    assert (a["state"], a["offload_keys"], a["offload_keys_destroyed"]) == ("acknowledged", 2, 0)
    assert a["missing"] == ["key.shred entries for 2 offload data keys"]
    assert (b["state"], b["offload_keys"], b["missing"]) == ("done", None, [])
    assert env.call("acme", "GET", f"/v1/purges/{job_id}/certificate").status_code == 409
    tiered.shred(limit=1)
    a = _engine(_job(env, job_id), "engine-a")
    assert (a["offload_keys_destroyed"], a["missing"]) == (
        1,
        ["key.shred entries for 1 offload data key"],
    )
    tiered.shred()
    job = _job(env, job_id)
    assert job["status"] == "done" and _engine(job, "engine-a")["missing"] == []
    r = env.call("acme", "GET", f"/v1/purges/{job_id}/certificate")
    assert r.status_code == 200, r.text
    assert env.signing_key is not None
    return env, r.json(), env.signing_key.verifier_key()


def _leaf_obj(entry: dict[str, Any]) -> dict[str, Any]:
    return erasure.parse_leaf(base64.b64decode(entry["leaf"]))


def test_offload_certificate_carries_and_proves_the_key_shreds(
    issued_offload: tuple[ApiEnv, Cert, str], tmp_path: Path
) -> None:
    _env, cert, vkey = issued_offload
    shreds = _entries(cert, "shred")
    indices = [e["index"] for e in shreds]
    objs = [_leaf_obj(e) for e in shreds]
    assert [o["kind"] for o in objs] == ["key.shred", "key.shred"] and indices == sorted(indices)
    assert {o["details"]["command_id"] for o in objs} == {1}
    offload = cert["media"]["offload"]
    assert set(offload) == {
        "type",
        "method_used",
        "method_details",
        "keys_destroyed",
        "entries_deleted",
        "bytes_deleted",
        "key_shred_entries",
        "shredded_first",
        "shredded_last",
    }
    figures = {"keys_destroyed": 2, "entries_deleted": 5, "bytes_deleted": 5 * 4096}
    assert {k: offload[k] for k in figures} == figures
    assert offload["key_shred_entries"] == indices
    assert offload["shredded_first"] == min(o["ts"] for o in objs)
    assert offload["shredded_last"] == max(o["ts"] for o in objs)
    engines = {e["engine_id"]: e for e in cert["media"]["engines"]}
    assert engines["engine-a"]["offload"] == {**figures, "key_shred_entries": indices}
    assert "offload" not in engines["engine-b"]
    assert any("crypto-shredded" in n for n in cert["notes"])
    # every purge entry of the tier engine says what it had to destroy
    (purge_a,) = [
        o for o in map(_leaf_obj, _entries(cert, "purge")) if "tier_key_count" in o["details"]
    ]
    assert purge_a["details"]["tier_key_count"] == 2
    report = verify_certificate(cert, [vkey])
    assert (report.offload_keys_destroyed, report.blocks_cleared, report.engines) == (2, 3, 2)
    code, out = _cli(_write(tmp_path, cert), vkey)
    assert code == 0, out
    assert "3 blocks cleared on 2 engines, 2 offload data keys destroyed," in out


def _drop_shred(cert: Cert) -> None:
    cert["evidence"]["entries"].remove(_entries(cert, "shred")[-1])


def _alter_shred_leaf(cert: Cert) -> None:
    """The leaf re-encoded canonically with another count: its inclusion proof no longer holds."""
    entry = _entries(cert, "shred")[0]
    obj = _leaf_obj(entry)
    obj["details"]["entry_count"] += 1
    leaf = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    entry["leaf"] = base64.b64encode(leaf).decode()


def _relabel_shred(cert: Cert) -> None:
    _entries(cert, "shred")[0]["role"] = "zeroize"


def _engine_offload(name: str, value: Any) -> Callable[[Cert], None]:
    def change(cert: Cert) -> None:
        engine = next(e for e in cert["media"]["engines"] if e["engine_id"] == "engine-a")
        engine["offload"][name] = value

    return change


def _offload_on_plain_engine(cert: Cert) -> None:
    engine = next(e for e in cert["media"]["engines"] if e["engine_id"] == "engine-b")
    engine["offload"] = {
        "keys_destroyed": 0,
        "entries_deleted": 0,
        "bytes_deleted": 0,
        "key_shred_entries": [],
    }


OFFLOAD_TAMPERING: dict[str, tuple[Callable[[Cert], None], str]] = {
    "key.shred entry dropped": (_drop_shred, "without a key.shred entry: 1"),
    "key.shred counts altered": (_alter_shred_leaf, "inclusion|does not"),
    "key.shred relabelled": (_relabel_shred, "not a block.zeroize entry"),
    "keys claimed": (_set("media.offload.keys_destroyed", 3), "keys_destroyed"),
    "entries claimed": (_set("media.offload.entries_deleted", 4), "entries_deleted"),
    "bytes claimed": (_set("media.offload.bytes_deleted", 1), "bytes_deleted"),
    "indices claimed": (_set("media.offload.key_shred_entries", [1, 2]), "key_shred_entries"),
    "time claimed": (_set("media.offload.shredded_last", "2099-01-01T00:00:00Z"), "shredded"),
    "offload part removed": (lambda c: c["media"].pop("offload"), "media.offload"),
    "engine keys claimed": (_engine_offload("keys_destroyed", 1), "engine-a: offload"),
    "engine bytes claimed": (_engine_offload("bytes_deleted", 9), "engine-a: offload"),
    "engine offload removed": (
        lambda c: c["media"]["engines"][0].pop("offload"),
        "engine-a: offload",
    ),
    "offload on a plain engine": (_offload_on_plain_engine, "engine-b: offload"),
}


@pytest.mark.parametrize("name", list(OFFLOAD_TAMPERING))
def test_offload_tampering_is_caught(
    issued_offload: tuple[ApiEnv, Cert, str], tmp_path: Path, name: str
) -> None:
    _env, cert, vkey = issued_offload
    change, message = OFFLOAD_TAMPERING[name]
    bad = copy.deepcopy(cert)
    change(bad)
    with pytest.raises(VerificationError, match=message):
        verify_certificate(bad, [vkey])
    code, out = _cli(_write(tmp_path, bad), vkey)
    assert code == 1 and out.startswith("INVALID:"), out


def test_genuine_key_shreds_of_something_else_are_refused(
    issued_offload: tuple[ApiEnv, Cert, str],
) -> None:
    """A key.shred of another job, and one of an expiry (no job), proven against the checkpoint."""
    env, _cert, vkey = issued_offload
    other = SimEngine(env.services, "engine-c", tier=True)
    other.spill(scope("globex"), 1, 4096)
    other.spill(scope("globex", session="s"), 1, 4096)
    job = env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "globex"})
    other.run_commands()
    other.shred(limit=1)
    other.shred(command_id=None, reason="expiry")
    env.services.ledger.checkpoint()
    fresh = env.call("acme", "GET", "/v1/purges/1/certificate").json()
    verify_certificate(fresh, [vkey])
    size = fresh["evidence"]["tree_size"]
    page = env.services.ledger.query(kinds=["key.shred"], limit=100)
    used = {e["index"] for e in fresh["evidence"]["entries"]}
    foreign = [r for r in page.records if r.index not in used and r.index < size]
    assert len(foreign) >= 2 and job.status_code == 202
    for record in foreign:
        bad = copy.deepcopy(fresh)
        proof = env.services.ledger.inclusion_proof(record.index, size)
        bad["evidence"]["entries"].append(
            {
                "role": "shred",
                "index": record.index,
                "leaf": base64.b64encode(record.leaf).decode(),
                "inclusion_proof": [base64.b64encode(h).decode() for h in proof],
            }
        )
        with pytest.raises(VerificationError, match="a key shred of another job"):
            verify_certificate(bad, [vkey])


def test_shreds_of_another_engine_or_without_the_job_do_not_complete_it(env: ApiEnv) -> None:
    tiered = SimEngine(env.services, "engine-a", tier=True)
    tiered.spill(scope("acme"), 2, 8192)
    job_id = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    job_id = job_id.json()["job_id"]
    tiered.run_commands()
    tiered.shreds = tiered.shreds * 3  # the worker's report, replayed with the wrong details
    tiered.shred(limit=1, engine_id="engine-z")  # block ids and keys are per engine
    tiered.shred(limit=1, command_id=None)  # a purge's shred must name its job
    job = _job(env, job_id)
    assert job["status"] == "running"
    assert _engine(job, "engine-a")["missing"] == ["key.shred entries for 1 offload data key"]
    tiered.shred()
    assert _job(env, job_id)["status"] == "done"
    cert = env.call("acme", "GET", f"/v1/purges/{job_id}/certificate").json()
    assert cert["media"]["offload"]["keys_destroyed"] == 1
    assert cert["media"]["kv_cache_blocks"]["quarantined"] == 0
    assert env.signing_key is not None
    verify_certificate(cert, [env.signing_key.verifier_key()])


def test_a_tier_that_held_nothing_of_the_purge_adds_no_offload_part(env: ApiEnv) -> None:
    tiered = SimEngine(env.services, "engine-a", tier=True)
    tiered.cache(scope("acme"), [1])
    tiered.spill(scope("globex"), 1, 4096)
    job_id = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    job_id = job_id.json()["job_id"]
    tiered.run_commands()
    tiered.zeroize()
    assert _job(env, job_id)["status"] == "done"
    cert = env.call("acme", "GET", f"/v1/purges/{job_id}/certificate").json()
    (purge,) = [_leaf_obj(e) for e in _entries(cert, "purge")]
    assert purge["details"]["tier_key_count"] == 0
    assert "offload" not in cert["media"] and not _entries(cert, "shred")
    assert env.signing_key is not None
    assert verify_certificate(cert, [env.signing_key.verifier_key()]).offload_keys_destroyed == 0


def test_certificates_without_a_tier_keep_their_shape(issued: tuple[ApiEnv, Cert, str]) -> None:
    _env, cert, vkey = issued
    assert set(cert["media"]) == {"type", "engines", "kv_cache_blocks"}
    assert all("offload" not in e for e in cert["media"]["engines"])
    assert {e["role"] for e in cert["evidence"]["entries"]} == {"request", "purge", "zeroize"}
    for path in ("media.offload", "media.engines.0.offload"):
        bad = copy.deepcopy(cert)
        _set(path, {"keys_destroyed": 0})(bad)
        with pytest.raises(VerificationError, match="offload"):
            verify_certificate(bad, [vkey])


def test_the_certificate_states_the_engine_count_its_request_entry_recorded(
    issued: tuple[ApiEnv, Cert, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier compares `job.engines_expected` with the request entry's count; the issuer
    takes it from that entry, not from the registry at report time, which can count differently
    (an engine whose heartbeat was stale when the job was created and is fresh now)."""
    from kvguard.api import purge_jobs  # noqa: PLC0415

    env, _cert, vkey = issued
    monkeypatch.setattr(purge_jobs.JobReport, "engines_expected", property(lambda _self: 3))
    fresh = env.call("acme", "GET", "/v1/purges/1/certificate").json()
    assert fresh["job"]["engines_expected"] == 2
    verify_certificate(fresh, [vkey])
