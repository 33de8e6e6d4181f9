"""G6 sweep (independent review): leaks found by planting canaries in client-controlled fields of
the real user paths and grepping everything kvguard writes.

A database password holding an unescaped `@` (`kvguard:Tr0ub4dor@SECRETTAIL9@db/kvguard`, a
common slip: the password is meant to be `Tr0ub4dor@SECRETTAIL9`) is split by SQLAlchemy's URL
parser at the first `@`: it masks `Tr0ub4dor` and takes `SECRETTAIL9@db` for the host, so every
CLI error prints the rest of the password in the clear (`kvguard.cli_output.safe_url`, used by
`reporting` for `cannot open database ...`); `kvguard engine serve` and `GuardedLLM` likewise hand
vLLM `postgresql+psycopg://kvguard@SECRETTAIL9@db/kvguard` to print among its non-default
arguments (`kvguard.engine_adapter.vllm.runtime._keep_password`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
URL = "postgresql+psycopg://kvguard:Tr0ub4dor@SECRETTAIL9@127.0.0.1:1/kvguard"


def test_cli_error_does_not_print_the_tail_of_a_password_with_an_at_sign() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvguard.cli", "purge", "--db", URL, "--tenant", "acme", "--json"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    out = r.stdout + r.stderr
    assert "Tr0ub4dor" not in out
    assert "SECRETTAIL9" not in out, out


def test_engine_config_url_does_not_keep_the_tail_of_a_password_with_an_at_sign() -> None:
    import pytest  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.runtime import _keep_password  # noqa: PLC0415
    from kvguard.errors import ConfigError  # noqa: PLC0415

    passwords: dict[str, str] = {}
    # What vLLM would print among its non-default arguments: such a URL is refused instead.
    with pytest.raises(ConfigError, match="unescaped '@'") as refused:
        _keep_password(URL, passwords)
    assert "SECRETTAIL9" not in str(refused.value) and not passwords
