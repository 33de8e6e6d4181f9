"""G6: secrets, salts, API keys, token ids and prompts never reach log output."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from kvguard.errors import ConfigError
from kvguard.isolation import CacheConfig, Keyring, ModelRef, SaltDeriver, Scope, TokenizerRef
from kvguard.logging import (
    REDACTED,
    configure_logging,
    get_logger,
    is_sensitive_name,
    redact,
    register_secret,
)
from kvguard.settings import Settings

SECRET = b"planted-secret-0123456789abcdefXYZ!"
API_KEY = "kvg_PlantedApiKey_abcdefghijklmnop"
PROMPT = "the quarterly numbers for project nightingale"


def _scope() -> Scope:
    return Scope(
        tenant_id="acme",
        model=ModelRef(id="m", revision="1"),
        tokenizer=TokenizerRef(id="t", revision="1"),
        cache_config=CacheConfig(kv_dtype="bf16", block_size=16),
    )


@pytest.mark.parametrize("json_output", [True, False])
def test_G6_planted_secrets_never_logged(tmp_path, json_output) -> None:
    out = io.StringIO()
    configure_logging("DEBUG", json_output=json_output, stream=out)
    ring_path = Keyring({"k1": SECRET}, active="k1").save(tmp_path / "salt.keys")
    deriver = SaltDeriver(Settings(salt_keyring_file=ring_path).load_keyring())
    salt = deriver.salt(_scope())
    log = get_logger("test")
    log.info(
        "request",
        tenant="acme",
        cache_salt=salt,
        api_key=API_KEY,
        prompt=PROMPT,
        prompt_token_ids=[48611, 73129, 90417],
        tokens_matched=32,
        scope_tag=deriver.scope_tag(_scope()),
    )
    log.info("free text", note=f"client sent {salt} with header Bearer {API_KEY}")
    log.info("nested", request={"headers": {"Authorization": f"Bearer {API_KEY}"}, "salt": salt})
    try:
        raise ConfigError(f"bad key material {SECRET.decode()} / {salt}")
    except ConfigError:
        log.exception("failure")
    text = out.getvalue()
    for planted in (
        SECRET.decode(),
        SECRET.hex(),
        salt,
        salt.split(":")[1],
        API_KEY,
        PROMPT,
        "73129",
    ):
        assert planted not in text, planted
    assert REDACTED in text
    assert "tokens_matched" in text and "32" in text  # counts stay readable
    assert deriver.scope_tag(_scope()) in text  # pseudonyms are what logs should carry


def test_json_lines_carry_utc_timestamp_and_context() -> None:

    out = io.StringIO()
    configure_logging(json_output=True, stream=out)
    structlog.contextvars.bind_contextvars(request_id="r-1")
    try:
        get_logger("x").info("hello")
    finally:
        structlog.contextvars.clear_contextvars()
    line = json.loads(out.getvalue().splitlines()[-1])
    assert line["request_id"] == "r-1" and line["timestamp"].endswith("Z")


def test_exception_rendering_has_no_locals() -> None:
    out = io.StringIO()
    configure_logging(json_output=True, stream=out)
    local_secret = "local-variable-value-" + "q" * 10  # noqa: F841
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("x").exception("failed")
    assert "local-variable-value" not in out.getvalue()


@pytest.mark.parametrize(
    ("name", "sensitive"),
    [
        ("api_key", True),
        ("cacheSalt", True),
        ("X-Api-Key", True),
        ("prompt_token_ids", True),
        ("secret", True),
        ("password", True),
        ("monkey", False),
        ("key_id", False),
        ("scope_tag", False),
        ("tenant", False),
        ("block_ids", False),
    ],
)
def test_sensitive_names(name, sensitive) -> None:
    assert is_sensitive_name(name) is sensitive


def test_counts_survive_but_sensitive_lists_do_not() -> None:
    out = redact(None, "info", {"num_tokens": 5, "tokens": [1, 2], "token_count": 9})
    assert out == {"num_tokens": 5, "tokens": REDACTED, "token_count": 9}


def test_logging_follows_the_current_stderr_not_a_closed_one(monkeypatch) -> None:
    """A CLI harness swaps stderr and closes it afterwards; a later log line (possibly from a
    background thread) must go to the stderr of that moment, never raise on the closed one."""
    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)
    configure_logging("INFO", json_output=True)
    swapped.close()
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    get_logger("t").warning("after the swap")
    assert "after the swap" in now.getvalue()


def test_a_secret_registered_after_lines_were_logged_is_masked_from_then_on() -> None:
    """The sorted list of registered secrets is built when one is registered, not per line: a
    secret registered after the first lines (a key issued while the server runs) is masked in the
    next line, longest match first."""
    out = io.StringIO()
    configure_logging("INFO", json_output=True, stream=out)
    log = get_logger("test")
    log.info("before", note="nothing secret yet")
    late = "late-registered-secret-7f3a9c"
    register_secret(late)
    register_secret(late + "-and-longer")
    log.info("after", note=f"value {late}-and-longer and {late}", label_key_words=late)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert late not in out.getvalue()
    assert lines[1]["note"] == f"value {REDACTED} and {REDACTED}"
    assert lines[1]["label_key_words"] == REDACTED  # by name too ("key")


def test_a_byte_secret_is_masked_in_the_base64_form_its_key_file_holds() -> None:
    """Found by a review: salt keys and signing seeds were registered raw and in hex, while their
    files hold them in base64; a log line quoting a file's value went out unmasked."""
    import base64  # noqa: PLC0415
    import os  # noqa: PLC0415

    out = io.StringIO()
    configure_logging("INFO", json_output=True, stream=out)
    secret = os.urandom(32)
    register_secret(secret)
    forms = [
        base64.b64encode(secret).decode(),
        base64.urlsafe_b64encode(secret).decode().rstrip("="),
    ]
    get_logger("test").info("quoted", note=f"a {forms[0]} b {forms[1]} c")
    assert all(form not in out.getvalue() for form in forms)
