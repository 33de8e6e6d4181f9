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


def test_ledger_commit_interval_reaches_the_ledger_writer_and_is_bounded(tmp_path) -> None:
    """Fewer group commits take less CPU from the engine but widen what a kill -9 loses: the
    interval is the operator's choice within a bound, and it is what the writer uses."""
    extra = GuardOptions(**write_secrets(tmp_path)).to_extra_config()
    assert GuardOptions.from_extra_config(extra).ledger_commit_interval_s == 0.05
    for bad in (0, -1, True, "0.2"):
        with pytest.raises(ConfigError, match="ledger_commit_interval_s: expected a number > 0"):
            GuardOptions.from_extra_config({**extra, "ledger_commit_interval_s": bad})
    with pytest.raises(ConfigError, match=r"more than 5\.0 s of entries"):
        GuardOptions.from_extra_config({**extra, "ledger_commit_interval_s": 30})
    options = GuardOptions.from_extra_config({**extra, "ledger_commit_interval_s": 0.25})
    assert GuardOptions.from_extra_config(options.to_extra_config()) == options
    ledger = options.open_ledger()
    try:
        assert ledger._writer._interval == 0.25
    finally:
        ledger.close()
