"""Adversarial review of the command line and of what leaves the process (G6, metrics).

Every test here failed on the code before its fix (the review of 2026-11-28 numbered the findings
F1-F13; the test names keep the numbers).
The CLI tests run in-process with Typer's `CliRunner` (an uncaught exception there is a traceback
for a user: `result.exception` is then not a `SystemExit`). One test needs a FIFO and runs the
command in a child process with a timeout; one needs the session's real vLLM engine (`guarded`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.cli import app
from kvguard.errors import ConfigError
from kvguard.isolation.keyring import Keyring
from tests.audit.conftest import make_event
from tests.dbs import sqlite_with_tenants

runner = CliRunner()
ORIGIN = "log.kvguard.test/review"
SECRET_PW = "s3cret-review-pw"  # a canary, not a credential


def _no_traceback(result: Result) -> None:
    """The command ended through the exit-code table, not through an uncaught exception."""
    assert result.exception is None or isinstance(result.exception, SystemExit | typer.Exit), (
        f"uncaught {type(result.exception).__name__}: {result.exception}"
    )


def _one_line_error(result: Result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- F2: a database URL whose port is not a number --------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["purge", "--tenant", "acme"],
        ["db", "migrate"],
        ["keys", "create", "--role", "admin"],
        ["keys", "tenant-key", "list"],
    ],
)
@pytest.mark.parametrize("port", ["port", "[::1"])
def test_F2_malformed_database_url_is_a_usage_error_without_traceback(
    args: list[str], port: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    host = "db.example:port" if port == "port" else "[::1"
    url = f"postgresql+psycopg://kvguard:{SECRET_PW}@{host}/kvguard"
    result = runner.invoke(app, [*args, "--db", url])
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert SECRET_PW not in result.output


# --- F3: --max-unsigned-age that overflows a timedelta ----------------------------------------


@pytest.mark.parametrize("age", ["1e14", "99999999999d", "1e300"])
def test_F3_huge_max_unsigned_age_is_a_usage_error(age: str, tmp_path: Path) -> None:
    from kvguard.audit.cli import parse_duration  # noqa: PLC0415

    with pytest.raises(ValueError, match="duration"):
        parse_duration(age)
    key = SigningKey.generate("log.kvguard.test")
    key.save(tmp_path / "signing.key")
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}", origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(3)])
    ledger.close()
    args = ["audit", "verify-db", "--db", f"sqlite:///{tmp_path / 'l.db'}", "--origin", ORIGIN]
    result = runner.invoke(
        app, [*args, "--key", str(tmp_path / "signing.key"), "--max-unsigned-age", age]
    )
    _no_traceback(result)
    assert result.exit_code == 2, result.output  # 1 would tell a script the ledger is invalid


# --- F4 / F5: `kvguard serve` options -------------------------------------------------------


@pytest.fixture
def serve_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Dev-mode secrets under tmp_path and a uvicorn that records what it was asked to serve
    (and, for a negative port, fails to start the way uvicorn does: exit 3)."""
    import uvicorn  # noqa: PLC0415

    monkeypatch.setenv("KVGUARD_MODE", "dev")
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    runs: list[dict[str, Any]] = []

    def run(app_: Any, **kwargs: Any) -> None:
        runs.append(kwargs)
        app_.state.services.close()
        if int(kwargs["port"]) < 0:  # uvicorn cannot bind it and exits 3; a port above 65535
            raise SystemExit(3)  # is bound modulo 65536 (99999 -> 34463), so it "works"

    monkeypatch.setattr(uvicorn, "run", run)
    return runs


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_F4_serve_refuses_a_port_outside_0_to_65535(
    port: str, serve_env: list[dict[str, Any]], tmp_path: Path
) -> None:
    """`--port 99999` served on 34463 (99999 mod 65536) while announcing :99999; `--port -1`
    ended in an OverflowError traceback from the bind probe (exit 1)."""
    result = runner.invoke(app, ["serve", "--db", f"sqlite:///{tmp_path / 'k.db'}", "--port", port])
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert serve_env == []  # refused before anything listens


def test_F5_serve_malformed_witness_key_is_a_usage_error(
    serve_env: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A malformed `--witness URL=VKEY` printed `INVALID:` and exited 1 ("the answer is no");
    `kvguard audit checkpoint --witness` reports the same mistake as a usage error (2)."""
    db = f"sqlite:///{tmp_path / 'k.db'}"
    result = runner.invoke(app, ["serve", "--db", db, "--witness", "https://w.example=badkey"])
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert "INVALID" not in result.output
    assert serve_env == []


# --- F6: a failed export leaves a half-written bundle -------------------------------------------


def test_F6_failed_export_leaves_no_partial_bundle(tmp_path: Path) -> None:
    """An export that fails on the way (here: a payload deleted behind the log's back) left
    checkpoint, entries.* and consistency.jsonl but no manifest; the directory then blocks the
    next export ("not empty"). Ctrl-C or SIGTERM part-way leaves the same (same code path)."""
    key = SigningKey.generate("log.kvguard.test")
    key.save(tmp_path / "signing.key")
    url = f"sqlite:///{tmp_path / 'l.db'}"
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
    events = [make_event(i) for i in range(40)]
    events[5] = make_event(5, payload={"tenant_id": "acme"})
    ledger.append_many(events)
    ledger.close()
    with sqlite3.connect(tmp_path / "l.db") as conn:
        conn.execute("DELETE FROM ledger_payloads")  # DELETE is what erasure is allowed to do
    out = tmp_path / "bundle"
    args = ["audit", "export", "--db", url, "--origin", ORIGIN]
    result = runner.invoke(app, [*args, "--key", str(tmp_path / "signing.key"), "--out", str(out)])
    _no_traceback(result)
    assert result.exit_code == 1, result.output
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert left == [], f"half-written bundle left behind: {left}"


# --- F7: commands that fail (or only read) create a database at a mistyped path -----------------


@pytest.mark.parametrize(
    "args",
    [
        ["keys", "revoke", "abcdef123456"],
        ["keys", "tenant-key", "revoke", "abcdef123456"],
        ["keys", "tenant-key", "create", "nosuch"],
    ],
)
def test_F7_failing_command_does_not_create_a_database(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path / "data"))
    typo = tmp_path / "typo.db"
    result = runner.invoke(app, [*args, "--db", f"sqlite:///{typo}"])
    _no_traceback(result)
    assert result.exit_code in {1, 2}, result.output
    assert not typo.exists(), "a new, fully migrated database was left at the mistyped path"


# --- F8: a keyring error echoes a key id that may be a pasted key --------------------------------


def test_F8_short_salt_key_error_does_not_echo_its_key_id() -> None:
    """`_check_kid` refuses to echo an id ("in a hand-edited file it may be a key pasted into the
    wrong place"), but the length check before it quoted the id in full."""
    pasted = "Q0FOQVJZLXNhbHQta2V5LXBhc3RlZC1hcy1hbi1pZC0xMjM0NTY3ODk="
    doc = json.dumps({"active": "k1", "keys": {pasted: "AAAA"}}).encode()
    with pytest.raises(ConfigError) as caught:
        Keyring.from_json(doc, source="salt.keys")
    assert pasted not in str(caught.value)


# --- F9: --trusted-checkpoint that is not a regular file -----------------------------------------


def test_F9_trusted_checkpoint_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    """`--trusted-checkpoint /dev/zero` read without bound (6 GB in 8 s); a FIFO blocks for ever.
    Bundle files are refused when they are not regular files; the pinned checkpoint was not."""
    key = SigningKey.generate("log.kvguard.test")
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}", origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(5)])
    ledger.export(tmp_path / "bundle")
    ledger.close()
    fifo = tmp_path / "pinned.fifo"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-m", "kvguard.cli", "verify", str(tmp_path / "bundle")]
    cmd += ["--key", key.verifier_key(), "--trusted-checkpoint", str(fifo)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("kvguard verify --trusted-checkpoint FIFO did not return within 30 s")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr


# --- F10 / F11: `kvguard purge` arguments -----------------------------------------------------


def _commands(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        try:
            return int(conn.execute("SELECT count(*) FROM engine_commands").fetchone()[0])
        except sqlite3.OperationalError:
            return 0


@pytest.mark.parametrize("tenant", ["bad tenant!", "a\nb", "t\u00e9nant"])
def test_F10_purge_refuses_a_tenant_id_that_cannot_exist(tenant: str, tmp_path: Path) -> None:
    """The API answers 422 for such an id (and 404 for an unknown one); the CLI queued the purge,
    recorded `purge.create` in the ledger and exited 0: an operator's typo reads as done."""
    db = tmp_path / "c.db"
    result = runner.invoke(app, ["purge", "--db", f"sqlite:///{db}", "--tenant", tenant])
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert _commands(db) == 0


@pytest.mark.parametrize("wait", ["-1", "nan"])
def test_F11_purge_refuses_a_negative_or_nan_wait_before_queuing(wait: str, tmp_path: Path) -> None:
    """`--wait -1` / `nan` queued the purge, then reported "no engine acknowledged" (exit 1)."""
    db = tmp_path / "c.db"
    args = ["purge", "--db", f"sqlite:///{db}", "--tenant", "acme", "--wait", wait]
    result = runner.invoke(app, args)
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert _commands(db) == 0


def test_F11_ctrl_c_while_waiting_still_reports_the_queued_purge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during `--wait` exited 130 with nothing on stdout or stderr, although the purge was
    committed: the operator cannot tell it was queued (and a retry queues a second one)."""

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("kvguard.control.cli.time.sleep", interrupted)
    db = tmp_path / "c.db"
    url = sqlite_with_tenants(db, "acme")
    from tests.test_cli_conventions import _live_engine  # noqa: PLC0415

    _live_engine(url)  # something to wait for
    args = ["purge", "--db", url, "--tenant", "acme", "--wait", "5", "--json"]
    result = runner.invoke(app, args)
    assert _commands(db) == 1  # it was queued
    assert result.exit_code == 130
    obj = json.loads(result.stdout)  # --json: stdout is one JSON object, also here
    assert obj["command_id"] == 1 and obj["interrupted"] is True
    # As every failing command's object: the error and the exit code (docs/cli.md), and the
    # selector of a queued purge (found by a docs review).
    assert obj["exit_code"] == 130 and obj["error"] and obj["selector"]["value"] == "acme"


# --- F12: a malformed KVGUARD_* setting --------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "args"),
    [
        ("KVGUARD_MODE", "bogus", ["keys", "salt-keyring"]),
        ("KVGUARD_MODE", "bogus", ["keys", "create", "--role", "admin"]),
        ("KVGUARD_MODE", "bogus", ["audit", "checkpoint"]),
        ("KVGUARD_OFFLOAD_BYTES", "x", ["keys", "tenant-key", "list"]),
    ],
)
def test_F12_malformed_setting_is_a_one_line_usage_error_naming_the_variable(
    variable: str, value: str, args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pydantic ValidationError from `Settings()` escaped `reporting()`: a traceback, exit 1."""
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv(variable, value)
    result = runner.invoke(app, args)
    _no_traceback(result)
    assert result.exit_code == 2, result.output
    assert variable in _one_line_error(result)


# --- F1: engine figures while the engine is idle ------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_F1_engine_figures_reach_the_registry_without_another_scheduler_step(
    guarded: Any,
) -> None:
    """Heartbeats are taken only in scheduler steps, at most every HEARTBEAT_S; an engine that goes
    idle after a burst runs no step, and its keep-alive only moves `last_seen`. Seen with
    `kvguard engine serve`: five requests (350 prompt tokens, five zeroizations in the ledger), then
    12 s idle: /metrics still said requests_total 1, prompt_tokens_total 0, zeroized_*_total 0, and
    the tenant had no row at all; after SIGTERM (vLLM kills the engine core) the figures and
    `stopped_at` never landed."""
    from vllm import SamplingParams  # noqa: PLC0415

    from kvguard.control.engines import EngineRegistry  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.reporting import HEARTBEAT_S  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import BLOCK  # noqa: PLC0415

    tenant = f"idle-figures-{time.time_ns()}"
    prompt = [(37 * i + 11) % 500 + 5 for i in range(2 * BLOCK + 3)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    guarded.generate([prompt], params, tenant=tenant)
    time.sleep(3 * HEARTBEAT_S + 1)  # idle: no scheduler step, only the link thread runs
    registry = EngineRegistry.open(guarded.options.ledger_url)
    try:
        rows = registry.tenant_stats(tenant)
        assert rows, "the tenant's figures never reached the registry while the engine idled"
        (row,) = rows
        assert row.prompt_tokens == len(prompt)
    finally:
        registry.engine.dispose()


# --- F13: evidence files are written through a symbolic link -------------------------------------


def test_F13_checkpoint_out_does_not_follow_a_symlink(tmp_path: Path) -> None:
    """`private_dir` refuses a symlinked directory ("the mode change would land on whatever it
    points at"), but `write_private_file` / `open_private` open with O_CREAT | O_TRUNC and no
    O_NOFOLLOW: `kvguard audit checkpoint --out LINK` truncated and chmod-ed the link's target
    (also `kvguard verify --save-checkpoint`, and the files of an export directory)."""
    key = SigningKey.generate("log.kvguard.test")
    key.save(tmp_path / "signing.key")
    url = f"sqlite:///{tmp_path / 'l.db'}"
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(3)])
    ledger.close()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    link = tmp_path / "checkpoint.note"
    link.symlink_to(victim)
    args = ["audit", "checkpoint", "--db", url, "--origin", ORIGIN]
    result = runner.invoke(app, [*args, "--key", str(tmp_path / "signing.key"), "--out", str(link)])
    _no_traceback(result)
    assert victim.read_text() == "precious\n", "the symlink's target was overwritten"
    assert victim.stat().st_mode & 0o777 == 0o644, "the symlink's target was chmod-ed"
    assert result.exit_code == 2, result.output


def test_audit_commands_give_up_on_a_database_server_that_never_answers(tmp_path: Path) -> None:
    """A PostgreSQL address that accepts connections and never answers (a partition, a wrong
    port): `audit verify-db` waited forever on a plain engine without the connect timeout every
    other command has (found by a review). Now exit 2 within seconds, naming no password."""
    import socket  # noqa: PLC0415

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # never accepted: the handshake completes, no byte ever comes back
        port = silent.getsockname()[1]
        url = f"postgresql+psycopg://postgres:hunter2@127.0.0.1:{port}/x"
        SigningKey.generate("log.example").save(tmp_path / "sign.key")
        env = {**os.environ, "KVGUARD_SIGNING_KEY_FILE": str(tmp_path / "sign.key")}
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "kvguard.cli", "audit", "verify-db", "--db", url],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 45
    assert "hunter2" not in done.stdout + done.stderr
