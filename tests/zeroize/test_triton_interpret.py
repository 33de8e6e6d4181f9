"""The Triton kernels themselves, on CPU tensors under TRITON_INTERPRET=1 (see interpret_cases)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.zeroize.interpret_cases import cases

pytestmark = pytest.mark.triton

_ROOT = Path(__file__).resolve().parents[2]


def _interpreter_missing() -> str | None:
    for module in ("triton", "numpy"):  # the interpreter runs kernels through numpy
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    missing = _interpreter_missing()
    if missing:
        pytest.skip(f"Triton interpreter unavailable: {missing}")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(_ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.zeroize.interpret_cases"],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    parsed: dict[str, str] = json.loads(run.stdout.strip().splitlines()[-1])
    return parsed


@pytest.mark.parametrize("case", sorted(cases()))
def test_kernel_under_interpreter(results: dict[str, str], case: str) -> None:
    assert results[case] == "ok", results[case]
