"""Shared set-up for the real-engine tests: key files, policy file and engine arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvguard.audit.signing import SigningKey
from kvguard.isolation import Keyring

BLOCK = 32
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
"""


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
