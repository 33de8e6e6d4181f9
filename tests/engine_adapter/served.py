"""A real `kvguard engine serve` process for the end-to-end tests (vLLM's OpenAI server on the CPU).

Production mode with explicit secret files (the path operators run), an SQLite database under the
test's directory, the packaged tiny Llama (dummy weights, word-level tokenizer with a chat template).
No `--block-size`: the server must take it from the engine's own configuration.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import sqlalchemy as sa

from kvguard.audit.signing import SigningKey
from kvguard.control.keys import TenantKeys
from kvguard.control.tenants import TenantRegistry
from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir
from kvguard.isolation import Keyring
from kvguard.policy import prefix_digest

ROOT = Path(__file__).resolve().parents[2]
POLICY = """\
version: 1
default:
  reuse: tenant
tenants:
  disabled-co:
    enabled: false
  tight:
    quota:
      max_blocks: 4
      when_full: reject
  offl:
    offload: {allowed: true, ttl_s: 3600}
  shr-a: {reuse: group, groups: [docs]}
  shr-b: {reuse: group, groups: [docs]}
share_groups:
  docs:
    prefixes: [{id: docs/system, digest: "%(digest)s", tokens: %(tokens)d}]
    min_shared_tokens: 128
"""
TENANTS = (
    "acme", "globex", "disabled-co", "rev", "initech", "tight", "offl", "shr-a", "shr-b", "shr-x",
)  # fmt: skip
# The `docs` share group's one listed prefix (300 words of the tiny tokenizer, one token each, no
# BOS): shr-a and shr-b may share its whole blocks, and nothing else, with X-KVGuard-Share.
GROUP_PREFIX = " ".join(["ka ke ki ko ku"] * 60)


def group_prefix_ids() -> list[int]:
    """GROUP_PREFIX as vLLM tokenizes it (the packaged tokenizer.json; `tokenizers` loads in
    milliseconds, transformers in seconds)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    tokenizer = Tokenizer.from_file(str(tiny_llama_dir() / "tokenizer.json"))
    return list(tokenizer.encode(GROUP_PREFIX).ids)


def policy_text() -> str:
    ids = group_prefix_ids()
    return POLICY % {"digest": prefix_digest(ids), "tokens": len(ids)}


OFFLOAD_BYTES = 32 << 20  # kvguard's encrypted tier: only `offl` may use it


@dataclass
class Served:
    base_url: str
    model: str
    db_url: str
    workdir: Path
    proc: subprocess.Popen[bytes]

    def keys(self) -> TenantKeys:
        return TenantKeys.open(self.db_url)

    def log_tail(self, n: int = 6000) -> str:
        return (self.workdir / "serve.log").read_text(errors="replace")[-n:]


LORA_NAME = "tiny-lora"
# A second adapter that no test rewrites, for tests that need an adapter's own repeat hits after
# another test on the shared server changed LORA_NAME's files (a changed adapter reuses nothing).
EDGE_LORA_NAME = "edge-lora"


def write_lora(directory: Path, seed: int) -> None:
    """A PEFT LoRA adapter (rank 4 on q_proj and v_proj) for the tiny Llama, weights from `seed`."""
    import json  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj, out_dim in (("q_proj", 128), ("v_proj", 64)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(4, 128, generator=g) * 0.1
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out_dim, 4, generator=g) * 0.1
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny-llama",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(workdir: Path, *extra: str, timeout_s: float = 300.0) -> Served:
    workdir.mkdir(parents=True, exist_ok=True)
    Keyring.generate().save(workdir / "salt.keys")
    SigningKey.generate("kvguard.test/ledger").save(workdir / "sign.key")
    (workdir / "policy.yaml").write_text(policy_text())
    db_url = f"sqlite:///{workdir / 'kvguard.db'}"
    registry = TenantRegistry(sa.create_engine(db_url))
    for tenant in TENANTS:
        registry.create(tenant, display_name=tenant, created_by="test")
    port = _free_port()
    model = str(tiny_llama_dir())
    write_lora(workdir / "lora", seed=1)
    write_lora(workdir / "edge-lora", seed=1)
    argv = [
        sys.executable, "-m", "kvguard.cli", "engine", "serve", model,
        "--load-format", "dummy", "--enforce-eager", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(8 << 20), "--max-num-seqs", "8",
        "--enable-prompt-tokens-details", "--port", str(port), "--host", "127.0.0.1",
        "--seed", "0", "--enable-lora", "--max-lora-rank", "8",
        "--lora-modules", f"{LORA_NAME}={workdir / 'lora'}",
        f"{EDGE_LORA_NAME}={workdir / 'edge-lora'}", *extra,
    ]  # fmt: skip
    return _launch(workdir, db_url, model, argv, port, "serve.log", timeout_s)


def restart(old: Served, timeout_s: float = 300.0) -> Served:
    """`old`'s command, secrets and database again, on a new port (after it stopped or was killed)."""
    argv = [str(a) for a in old.proc.args]  # type: ignore[union-attr]
    port = _free_port()
    argv[argv.index("--port") + 1] = str(port)
    return _launch(old.workdir, old.db_url, old.model, argv, port, "serve-restart.log", timeout_s)


def _launch(
    workdir: Path,
    db_url: str,
    model: str,
    argv: list[str],
    port: int,
    log_name: str,
    timeout_s: float,
) -> Served:
    env = {
        **os.environ,
        "KVGUARD_MODE": "prod",
        "KVGUARD_DATA_DIR": str(workdir / "data"),
        "KVGUARD_DB_URL": db_url,
        "KVGUARD_SALT_KEYRING_FILE": str(workdir / "salt.keys"),
        "KVGUARD_SIGNING_KEY_FILE": str(workdir / "sign.key"),
        "KVGUARD_POLICY_FILE": str(workdir / "policy.yaml"),
        "KVGUARD_OFFLOAD_BYTES": str(OFFLOAD_BYTES),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs the engine core as vLLM does
    log = (workdir / log_name).open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    served = Served(f"http://127.0.0.1:{port}", model, db_url, workdir, proc)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"kvguard engine serve exited ({proc.returncode}):\n{served.log_tail()}"
            )
        try:
            if httpx.get(served.base_url + "/health", timeout=1).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(served)
    raise RuntimeError(f"kvguard engine serve did not come up:\n{served.log_tail()}")


def stop(served: Served) -> None:
    served.proc.terminate()
    try:
        served.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait(timeout=10)
