"""Issue 13, item 6: a real `kvguard serve` writes every stderr line as one structlog JSON object,
uvicorn's own lines included, with an access line per request and the same redaction (no API key
in any line, not even when it arrives where a tenant name should)."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from kvguard.control.keys import ApiKeys, Role

from .test_crash_consistency import Api


@pytest.mark.parametrize("workers", [1, 2])
def test_server_log_lines_are_json_redacted_with_uvicorns_and_access_lines(
    tmp_path: Path, workers: int
) -> None:
    """With `--workers 2` the worker processes wrote no access line (they logged at WARNING: the
    parent's logging did not reach them; found by a review)."""
    db_url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    api = Api(db_url, tmp_path)
    api.extra_args = ["--workers", str(workers)]
    engine = sa.create_engine(db_url)
    api.start()  # migrates the database
    try:
        admin = ApiKeys(engine).create(Role.ADMIN).api_key
        headers = {"Authorization": f"Bearer {admin}"}
        assert httpx.get(f"{api.url}/v1/tenants", headers=headers).status_code == 200
        assert httpx.get(f"{api.url}/v1/tenants/{admin}", headers=headers).status_code == 404
        wrong = admin[:-4] + "AAAA"
        assert (
            httpx.get(
                f"{api.url}/v1/tenants", headers={"Authorization": f"Bearer {wrong}"}
            ).status_code
            == 401
        )
        assert httpx.get(f"{api.url}/no/such/route").status_code in (401, 404)
        # Both workers writing at once: print() wrote a line and its newline separately, and
        # the workers' lines broke into each other (found by a benchmark's log).
        with ThreadPoolExecutor(8) as pool:
            burst = list(
                pool.map(
                    lambda _: httpx.get(f"{api.url}/v1/tenants", headers=headers).status_code,
                    range(400),
                )
            )
        assert burst == [200] * 400
    finally:
        assert api.proc is not None
        api.proc.send_signal(signal.SIGTERM)
        api.proc.wait(15)
        engine.dispose()
    text = (tmp_path / "serve.log").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is JSON
    components = {line.get("component") for line in lines}
    assert "uvicorn.error" in components, components  # uvicorn's own lines, through structlog
    assert "uvicorn.access" not in components  # kvguard's access line replaces it: one per request
    assert any("startup complete" in str(line.get("event")) for line in lines)
    assert any("Shutting down" in str(line.get("event")) for line in lines)
    requests = [line for line in lines if line.get("event") == "request"]
    assert sum(r["route"] != "/healthz" for r in requests) == 404  # each request once
    assert {(r["route"], r["status"]) for r in requests} >= {
        ("/v1/tenants", 200),
        ("unmatched", 401),  # refused before routing (authentication comes first)
        ("/v1/tenants/{tenant_id}", 404),
    }
    assert all(line.get("timestamp", "").endswith("Z") for line in lines)
    # uvicorn's `color_message` (its message again, with ANSI colour codes) is left out.
    assert not any("color_message" in line for line in lines) and "\x1b[" not in text
    secret = admin[-43:]  # kvg_adm_<key id>_<43-character secret>
    assert admin not in text and secret not in text and wrong not in text
