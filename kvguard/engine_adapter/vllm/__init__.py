"""kvguard for vLLM: a KV connector that governs prefix caching and zeroizes released blocks, and
`GuardedLLM`, a wrapper of `vllm.LLM` that derives cache salts on the server.

The connector is loaded by vLLM itself through `KVTransferConfig(kv_connector="KVGuardConnector",
kv_connector_module_path="kvguard.engine_adapter.vllm.connector", kv_role="kv_both",
kv_connector_extra_config={...})`; see docs/vllm.md for the configuration keys. Importing this package
does not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM

__all__ = ["GuardedLLM"]


def __getattr__(name: str) -> Any:
    if name == "GuardedLLM":
        from kvguard.engine_adapter.vllm.guarded import GuardedLLM  # noqa: PLC0415 (lazy: vLLM is heavy)

        return GuardedLLM
    raise AttributeError(name)
