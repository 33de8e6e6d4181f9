#!/usr/bin/env bash
# Build kvguard's wheel and install it into a clean virtual environment, as a user would: CPU torch
# first (a bare `torch` requirement with no torch installed pulls a multi-GB CUDA build), then the
# wheel with its declared dependencies only (no dev extras, no vLLM). Then import every package,
# run the CLI, and check that the engine commands without vLLM print the one-line install hint
# (exit 2) instead of a traceback. Issue 13, item 1.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${KVGUARD_TORCH_SPEC:-torch==2.13.0}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "==> building the wheel"
"$PYTHON" -m pip --disable-pip-version-check wheel -q --no-deps -w "$WORK/dist" .
WHEEL="$(ls "$WORK"/dist/kvguard-*.whl)"
echo "==> clean venv: $TORCH_SPEC, then $(basename "$WHEEL")"
"$PYTHON" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q "$TORCH_SPEC"
"${PIP[@]}" install -q "$WHEEL"

cd "$WORK"  # not the source tree: the installed wheel must stand alone
echo "==> importing every kvguard package"
"$WORK/venv/bin/python" - <<'PY'
import importlib
import pkgutil

import kvguard

skipped = ("kvguard.engine_adapter.vllm", "kvguard.zeroize._kernels")  # need vLLM / Triton (extras)
for info in pkgutil.walk_packages(kvguard.__path__, "kvguard."):
    if info.name.startswith(skipped) or ".migrations." in info.name:
        continue
    importlib.import_module(info.name)
import kvguard.zeroize  # the issue's failing import: torch must come with the wheel's requirements
print("imported", kvguard.__version__)
PY
"$WORK/venv/bin/kvguard" --version
"$WORK/venv/bin/kvguard" policy validate --help >/dev/null
set +e
OUT="$("$WORK/venv/bin/kvguard" demo 2>&1)"
CODE=$?
set -e
if [ "$CODE" != 2 ] || ! grep -q "kvguard\[vllm\]" <<<"$OUT" || grep -q Traceback <<<"$OUT"; then
    echo "kvguard demo without vLLM: expected exit 2 and the install hint, got $CODE:" >&2
    echo "$OUT" >&2
    exit 1
fi
echo "==> wheel smoke test passed"
