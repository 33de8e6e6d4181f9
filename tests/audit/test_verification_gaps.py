"""Gaps found by an adversarial review of offline verification (each test failed before its fix).

1. A payload restored after its `payload.erase` entry (the app role holds INSERT on
   `ledger_payloads`) passed `verify-db`, was exported as "present", and the bundle verified although
   it proves, in the same file, the entry that erased it.
2. An erasure certificate that carries part 1 of a purge entry split into 2 parts (`part`/`parts`,
   `ledger_bridge.to_audit_events`) and leaves out part 2 verified.
3. A bundle file larger than memory (here a sparse `consistency.jsonl`) is read whole before the
   manifest's digests are checked: `kvguard verify` died with MemoryError and a traceback instead of
   answering INVALID.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from kvguard.api.app import create_app
from kvguard.api.auth import Role
from kvguard.api.services import Services
from kvguard.audit import erasure
from kvguard.audit import schema as t
from kvguard.audit.certificate import CLAIMS, ENGINE_CLAIMS, set_path, verify_certificate
from kvguard.audit.export import export_bundle
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError
from tests.api.conftest import ApiEnv, make_config
from tests.api.purge_support import SimEngine, scope

from .conftest import ORIGIN, make_event


def _ledger_with_restored_payload(tmp_path: Path) -> tuple[Ledger, SigningKey]:
    key = SigningKey.generate("log.kvguard.test")
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}", origin=ORIGIN, signing_key=key)
    for i in range(6):
        ledger.append(make_event(i, payload={"user": "erin"}) if i == 3 else make_event(i))
    with ledger.store.engine.connect() as conn:
        backup = conn.execute(sa.select(t.payloads)).all()
    ledger.erase_payload(3, reason="data_subject_request")
    with ledger.store.engine.begin() as conn:  # restored from a backup: INSERT only
        for row in backup:
            conn.execute(sa.insert(t.payloads).values(**row._mapping))
    return ledger, key


def test_verify_db_refuses_a_payload_restored_after_its_erasure(tmp_path: Path) -> None:
    ledger, _key = _ledger_with_restored_payload(tmp_path)
    try:
        with pytest.raises(VerificationError):
            ledger.verify()
    finally:
        ledger.close()


def test_a_bundle_cannot_state_present_a_payload_it_proves_erased(tmp_path: Path) -> None:
    ledger, key = _ledger_with_restored_payload(tmp_path)
    out = tmp_path / "bundle"
    try:
        try:
            export_bundle(ledger, out)
        except VerificationError:
            return  # the exporter refusing is a fix too
    finally:
        ledger.close()
    assert '"state":"present"' in (out / "payloads.jsonl").read_text()
    with pytest.raises(VerificationError):
        verify_bundle(out, [key.verifier_key()], origin=ORIGIN)


def _env(tmp_path: Path) -> ApiEnv:
    config, key = make_config(tmp_path, f"sqlite:///{tmp_path / 'kvguard.db'}")
    services = Services.open(config)
    env = ApiEnv(TestClient(create_app(services)), services, signing_key=key)
    services.tenants.create("acme", display_name="Acme", created_by="test")
    env.keys["acme"] = services.keys.create(Role.TENANT_ADMIN, tenant_id="acme").api_key
    return env


def _leaf(entry: dict[str, Any]) -> dict[str, Any]:
    return erasure.parse_leaf(base64.b64decode(entry["leaf"]))


def test_a_certificate_missing_a_part_of_a_split_purge_entry_is_refused(tmp_path: Path) -> None:
    env = _env(tmp_path)
    try:
        engine = SimEngine(env.services, "engine-a", num_blocks=5000)
        engine.cache(scope("acme"), list(range(4500)))  # > MAX_BLOCK_IDS: the purge entry splits
        r = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
        job_id = r.json()["job_id"]
        engine.run_commands()
        engine.zeroize()
        cert = env.call("acme", "GET", f"/v1/purges/{job_id}/certificate").json()
    finally:
        env.client.close()
        env.services.close()
    assert env.signing_key is not None
    vkey = env.signing_key.verifier_key()
    verify_certificate(cert, [vkey])
    bad = copy.deepcopy(cert)
    entries = bad["evidence"]["entries"]
    (part2,) = [e for e in entries if e["role"] == "purge" and _leaf(e)["details"]["part"] == 2]
    assert _leaf(part2)["details"]["parts"] == 2
    dropped = set(_leaf(part2)["block_ids"])
    kept = [
        e
        for e in entries
        if e is not part2 and not (e["role"] == "zeroize" and set(_leaf(e)["block_ids"]) <= dropped)
    ]
    bad["evidence"]["entries"] = kept
    objs = [(e["role"], e["index"], _leaf(e)) for e in kept]
    purges = [erasure.purge_entry(i, o) for role, i, o in objs if role == "purge"]
    zeroizes = [erasure.zeroize_entry(i, o) for role, i, o in objs if role == "zeroize"]
    coverage = erasure.cover(purges, zeroizes)
    shown = erasure.summary(purges, zeroizes, coverage)
    for path, name in CLAIMS.items():
        set_path(bad, path, shown[name])
    facts = erasure.engine_facts(purges, zeroizes, coverage)
    for listed in bad["media"]["engines"]:
        listed.update({name: facts[listed["engine_id"]][name] for name in ENGINE_CLAIMS})
    with pytest.raises(VerificationError):
        verify_certificate(bad, [vkey])


_LIMITED_VERIFY = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
sys.argv = ["kvguard", "verify", sys.argv[1], "--key", sys.argv[2], "--origin", sys.argv[3]]
from kvguard.cli import main
main()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and sparse files")
def test_a_bundle_file_larger_than_memory_is_invalid_not_a_crash(tmp_path: Path) -> None:
    key = SigningKey.generate("log.kvguard.test")
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}", origin=ORIGIN, signing_key=key)
    try:
        ledger.append_many([make_event(i) for i in range(4)])
        ledger.checkpoint()
        ledger.append_many([make_event(i) for i in range(4, 8)])
        out = tmp_path / "bundle"
        export_bundle(ledger, out)
    finally:
        ledger.close()
    with open(out / "consistency.jsonl", "r+b") as f:  # sparse: no disk used
        f.truncate(3 << 30)
    result = subprocess.run(
        [sys.executable, "-c", _LIMITED_VERIFY, str(out), key.verifier_key(), ORIGIN],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    output = result.stdout + result.stderr
    assert "MemoryError" not in output and "Traceback" not in output, output[-2000:]
    assert result.returncode == 1 and "INVALID" in output, output[-2000:]
