"""G7 at the engine: the connector's configuration fails closed."""

from __future__ import annotations

import pytest

from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.errors import ConfigError, FailClosedError
from tests.engine_adapter.vllm_support import write_secrets


def test_G7_connector_refuses_to_start_without_keyring_or_ledger(tmp_path) -> None:
    extra = GuardOptions(**write_secrets(tmp_path)).to_extra_config()
    for missing in ("salt_keyring_file", "ledger_url", "signing_key_file"):
        broken = {k: v for k, v in extra.items() if k != missing}
        with pytest.raises(FailClosedError, match=missing):
            GuardOptions.from_extra_config(broken)


def test_unknown_keys_are_refused_not_ignored(tmp_path) -> None:
    extra = GuardOptions(**write_secrets(tmp_path)).to_extra_config()
    with pytest.raises(ConfigError, match="verfy_override"):
        GuardOptions.from_extra_config({**extra, "verfy_override": "none"})


def test_round_trip(tmp_path) -> None:
    options = GuardOptions(
        **write_secrets(tmp_path), verify_override="full", commands_url="sqlite://"
    )
    assert GuardOptions.from_extra_config(options.to_extra_config()) == options
