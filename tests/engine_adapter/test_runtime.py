"""G7 at the engine: the connector's configuration fails closed."""

from __future__ import annotations

import os
import sys

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


def test_ledger_writer_nice_reaches_the_writer_thread_and_is_bounded(tmp_path) -> None:
    """The engine's ledger writer keeps the engine's priority unless told otherwise (0); an
    operator of a CPU engine may let it yield the cores to the forward passes (up to 19)."""
    extra = GuardOptions(**write_secrets(tmp_path)).to_extra_config()
    assert GuardOptions.from_extra_config(extra).ledger_writer_nice == 0
    for bad in (-1, 20, True, "5", 2.5):
        with pytest.raises(ConfigError, match="ledger_writer_nice: expected a whole number 0-19"):
            GuardOptions.from_extra_config({**extra, "ledger_writer_nice": bad})
    for nice in (0, 7, 19):
        options = GuardOptions.from_extra_config({**extra, "ledger_writer_nice": nice})
        assert GuardOptions.from_extra_config(options.to_extra_config()) == options
        ledger = options.open_ledger()
        try:
            ledger.flush()  # the writer thread is running (it set its priority first)
            tid = ledger._writer._thread.native_id
            if sys.platform.startswith("linux"):
                own = os.getpriority(os.PRIO_PROCESS, 0)
                assert os.getpriority(os.PRIO_PROCESS, tid) == max(nice, own)
        finally:
            ledger.close()


def test_an_engine_signs_with_both_keys_during_a_rotation(tmp_path, monkeypatch) -> None:
    """docs/operations.md: during a signing-key rotation both keys are configured and every
    checkpoint carries both signatures, so auditors holding either verifier key accept it. The
    engine's connector options carry the second key; `kvguard engine serve` reads both from
    KVGUARD_SIGNING_KEY_FILE (joined like PATH) and hands both to the front end's ledger."""
    import os  # noqa: PLC0415

    from kvguard.audit import note  # noqa: PLC0415
    from kvguard.audit.signing import SigningKey  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.launch import ServeConfig  # noqa: PLC0415
    from kvguard.settings import Settings  # noqa: PLC0415

    secrets = write_secrets(tmp_path)
    new = SigningKey.generate("kvguard.test/ledger")
    new.save(tmp_path / "new.key")
    options = GuardOptions(**secrets, more_signing_key_files=(tmp_path / "new.key",))
    assert GuardOptions.from_extra_config(options.to_extra_config()) == options
    with pytest.raises(ConfigError, match="more_signing_key_files"):
        GuardOptions.from_extra_config({**options.to_extra_config(), "more_signing_key_files": "x"})
    ledger = options.open_ledger()
    try:
        signed = ledger.checkpoint()
        old = SigningKey.load(secrets["signing_key_file"])
        for key in (old, new):  # either verifier alone accepts the checkpoint
            note.open_note(signed, [key.verifier()])
    finally:
        ledger.close()
    both = os.pathsep.join([str(secrets["signing_key_file"]), str(tmp_path / "new.key")])
    monkeypatch.setenv("KVGUARD_SIGNING_KEY_FILE", both)
    monkeypatch.setenv("KVGUARD_SALT_KEYRING_FILE", str(secrets["salt_keyring_file"]))
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path / "data"))
    config = ServeConfig.from_settings(Settings(), origin="kvguard.test/ledger")
    assert config.options.signing_key_file == secrets["signing_key_file"].resolve()
    assert config.options.more_signing_key_files == ((tmp_path / "new.key").resolve(),)
    assert config.environment()["KVGUARD_SIGNING_KEY_FILE"].split(os.pathsep) == [
        str(secrets["signing_key_file"].resolve()),
        str((tmp_path / "new.key").resolve()),
    ]


def test_engine_serve_takes_the_writer_priority_from_its_settings(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvguard engine serve` refuses `--kv-transfer-config`, so KVGUARD_LEDGER_WRITER_NICE is how
    its operator sets `ledger_writer_nice` (found by a re-test: no way to set it there)."""
    from kvguard.engine_adapter.vllm.launch import ServeConfig  # noqa: PLC0415 (imports vLLM)
    from kvguard.settings import Settings  # noqa: PLC0415

    secrets = write_secrets(tmp_path)
    monkeypatch.setenv("KVGUARD_SIGNING_KEY_FILE", str(secrets["signing_key_file"]))
    monkeypatch.setenv("KVGUARD_SALT_KEYRING_FILE", str(secrets["salt_keyring_file"]))
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path / "data"))
    config = ServeConfig.from_settings(Settings(), origin="kvguard.test/ledger")
    assert config.options.ledger_writer_nice == 0
    monkeypatch.setenv("KVGUARD_LEDGER_WRITER_NICE", "19")
    config = ServeConfig.from_settings(Settings(), origin="kvguard.test/ledger")
    assert config.options.to_extra_config()["ledger_writer_nice"] == 19
    for bad in ("20", "-1", "high"):
        monkeypatch.setenv("KVGUARD_LEDGER_WRITER_NICE", bad)
        with pytest.raises(ValueError, match="ledger_writer_nice"):
            Settings()
