#!/usr/bin/env bash
# What the dashboard's end-to-end test (tests/api/test_dashboard.py) drives: Debian's Chromium and the
# `playwright` Python package. Playwright's own browser download (`playwright install`) is never used:
# this machine reaches package registries only, and the test launches /usr/bin/chromium. Each part is
# installed only when missing, so running it again costs two checks.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PLAYWRIGHT_SPEC="${KVGUARD_PLAYWRIGHT_SPEC:-playwright>=1.48,<2}"

if [ ! -x /usr/bin/chromium ]; then
    echo "==> installing Debian's chromium"
    SUDO=()
    if [ "$(id -u)" != "0" ]; then SUDO=(sudo); fi
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends chromium
fi

if ! "$VENV/bin/python" -c "import playwright.sync_api" 2>/dev/null; then
    echo "==> installing $PLAYWRIGHT_SPEC into $VENV (its driver only; the browser is Debian's)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$PLAYWRIGHT_SPEC"
fi
echo "==> browser: $(/usr/bin/chromium --version 2>/dev/null || echo missing)"
