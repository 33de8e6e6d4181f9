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
from kvguard.audit.certificate import CLAIMS, set_path, verify_certificate
from kvguard.audit.cli import verify_command
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError
from tests.api.conftest import ApiEnv
from tests.api.purge_support import SimEngine, scope

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


def _without_engine(cert: Cert, engine_id: str) -> Cert:
    """`cert` less one engine, every other claim recomputed so that only the request can tell."""
    bad = copy.deepcopy(cert)
    kept = []
    for e in bad["evidence"]["entries"]:
        details = json.loads(base64.b64decode(e["leaf"]))["details"]
        if details.get("engine_id") != engine_id:
            kept.append(e)
    bad["evidence"]["entries"] = kept
    bad["media"]["engines"] = [e for e in bad["media"]["engines"] if e["engine_id"] != engine_id]
    objs = [(e["role"], e["index"], erasure.parse_leaf(base64.b64decode(e["leaf"]))) for e in kept]
    purges = [erasure.purge_entry(i, o) for r, i, o in objs if r == "purge"]
    zeroizes = [erasure.zeroize_entry(i, o) for r, i, o in objs if r == "zeroize"]
    shown = erasure.summary(purges, zeroizes, erasure.cover(purges, zeroizes))
    for path, key in CLAIMS.items():
        set_path(bad, path, shown[key])
    return bad


def test_a_whole_engine_left_out_is_caught_by_the_request_entry(
    issued: tuple[ApiEnv, Cert, str],
) -> None:
    _env, cert, vkey = issued
    bad = _without_engine(cert, "engine-b")
    with pytest.raises(VerificationError, match="fewer engines than were live"):
        verify_certificate(bad, [vkey])
    # Without the request entry (jobs queued by `kvguard purge` have none) the smaller claim is
    # self-consistent: the verifier cannot know an engine is missing (docs/audit.md says so).
    bad["evidence"]["entries"] = [e for e in bad["evidence"]["entries"] if e["role"] != "request"]
    assert verify_certificate(bad, [vkey]).engines == 1


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
