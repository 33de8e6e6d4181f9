"""Structured logging with redaction (G6).

Configured once per process by `configure_logging`. Follows structlog's guidance: `merge_contextvars`
first (bind `tenant` / `request_id` per request with `bind_contextvars`), UTC ISO timestamps, JSON lines
when stderr is not a TTY and a console renderer when it is, and exception rendering with
`show_locals=False` (structlog's rich default shows locals: a secret-leak path).

Two redaction layers, both running after exceptions are formatted so tracebacks are covered too:
1. by field name: any key that reads like a secret, salt, key, token or prompt is masked, at any depth;
2. by value: secret values registered with `register_secret` (signing keys, salt keys, API keys) are
   masked wherever they appear inside any string, including exception text;
3. by shape: anything shaped like a kvguard salt (`kid:` + 43 base64url characters, one SHA-256 MAC)
   or a kvguard API key (`kvg_` + base64url) is masked wherever it appears, since salts are too many to
   register one by one.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, MutableMapping
from typing import Any, Final, TextIO

import structlog

REDACTED = "[REDACTED]"

# Words that make a field name sensitive. Names are split on `_`, `-`, `.` and camelCase first, so
# `api_key`, `cacheSalt`, `prompt_token_ids` and `X-Api-Key` all match, while `monkey` does not.
_SENSITIVE_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "salt",
        "salts",
        "key",
        "keys",
        "apikey",
        "token",
        "tokens",
        "prompt",
        "prompts",
        "password",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "authorization",
        "cookie",
        "private",
        "seed",
    }
)
# Public identifiers that contain a sensitive word but are not secrets.
_PUBLIC_NAMES = frozenset({"key_id", "kid", "scope_tag", "verifier_key", "public_key", "key_ids"})
# Integer fields whose last word is one of these are counts (`tokens_matched=96`), not payloads.
_COUNT_WORDS = frozenset({"count", "matched", "avoided", "total", "len", "length", "num", "n"})
_WORD_SPLIT = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")
_MIN_SECRET_LEN = 6
_SHAPED_SECRETS = re.compile(
    r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{1,32}:[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"  # derived salts
    r"|kvg_[A-Za-z0-9_-]{16,}"  # API keys
)

_registered: set[str] = set()
_registered_lock = threading.Lock()
# `_registered`, longest first, rebuilt when a secret is registered (not on every line)
_registered_sorted: tuple[str, ...] = ()


def register_secret(value: str | bytes | bytearray) -> None:
    """Mask `value` wherever it appears in a log line; for bytes also their hex and base64 forms
    (standard and URL-safe, with and without padding: how key files hold them)."""
    texts: list[str] = []
    if isinstance(value, bytes | bytearray):
        raw = bytes(value)
        texts.append(raw.hex())
        for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
            text = encoded.decode("ascii")
            texts += [text, text.rstrip("=")]
        with contextlib.suppress(UnicodeDecodeError):
            texts.append(raw.decode("utf-8"))
    else:
        texts.append(value)
    global _registered_sorted  # noqa: PLW0603 (the one writer, under the lock)
    with _registered_lock:
        _registered.update(t for t in texts if len(t) >= _MIN_SECRET_LEN)
        _registered_sorted = tuple(sorted(_registered, key=len, reverse=True))


@functools.lru_cache(maxsize=4096)
def _name_words(name: str) -> tuple[str, ...]:
    """`name`'s words, lower-cased, in order. Cached: a server logs the same few field names on
    every line (splitting them was half the cost of an access-log line)."""
    return tuple(w.lower() for w in _WORD_SPLIT.split(name) if w)


def is_sensitive_name(name: str) -> bool:
    """True when a field name reads like it holds a secret, salt, key, token or prompt."""
    if name.lower() in _PUBLIC_NAMES:
        return False
    return not _SENSITIVE_WORDS.isdisjoint(_name_words(name))


def _is_count(name: str, value: object) -> bool:
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    words = _name_words(name)
    return bool(words) and (words[-1] in _COUNT_WORDS or words[0] in {"num", "n"})


def _scrub_text(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return _SHAPED_SECRETS.sub(REDACTED, text)


def _scrub(value: Any, secrets: tuple[str, ...]) -> Any:
    if isinstance(value, str):
        return _scrub_text(value, secrets)
    if isinstance(value, dict):
        return {k: _scrub_field(str(k), v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v, secrets) for v in value]
    if isinstance(value, bytes | bytearray):
        return REDACTED
    return value


def _scrub_field(name: str, value: Any, secrets: tuple[str, ...]) -> Any:
    if is_sensitive_name(name) and not _is_count(name, value):
        return REDACTED
    return _scrub(value, secrets)


def redact(_logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """structlog processor: mask sensitive fields by name and registered secrets by value."""
    secrets = _registered_sorted  # one read of a tuple rebuilt whole: no lock needed
    for name in list(event_dict):
        event_dict[name] = _scrub_field(name, event_dict[name], secrets)
    return event_dict


def _processors(json_output: bool) -> list[Any]:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json_output:
        shared.append(
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
        )
        return [*shared, redact, structlog.processors.JSONRenderer()]
    shared.append(structlog.processors.format_exc_info)
    return [
        *shared,
        redact,
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback),
    ]


class _CurrentStderr:
    """Whatever `sys.stderr` is when a line is written, not when logging was configured: test
    runners and CLI harnesses swap and close streams, and a logger holding a closed one would raise
    in whichever thread logs next (a background listener died of exactly that)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


_configured: dict[str, Any] = {}  # what configure_logging chose, for capture_stdlib_logging


def configure_logging(
    level: str = "INFO",
    *,
    json_output: bool | None = None,
    stream: TextIO | None = None,
    explicit: bool = True,
) -> None:
    """Configure structlog for this process. `json_output=None` picks JSON unless stderr is a TTY.
    `explicit=False`: the level is a command's default, which a server raises to INFO
    (`capture_stdlib_logging`)."""
    out: Any = stream if stream is not None else _CurrentStderr()
    if json_output is None:
        json_output = not out.isatty()
    _configured.update(level=level, json_output=json_output, out=out, explicit=explicit)
    structlog.configure(
        processors=_processors(json_output),
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write per line (message and newline together): `print` writes them separately, and
        # the worker processes of `kvguard serve --workers N` share one stderr, so their lines
        # interleaved mid-line and broke the one-JSON-object-per-line format.
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )


STDLIB_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "alembic", "sqlalchemy", "asyncio")
# Libraries whose INFO lines are not for operators: Alembic's context chatter, and SQLAlchemy's
# INFO is the SQL echo (statements with their parameters). They stay at WARNING whatever the level.
_QUIET = frozenset({"sqlalchemy", "asyncio", "alembic"})


def _drop_terminal_copies(
    _logger: Any, _name: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """uvicorn adds each message again as `color_message`, with ANSI colour codes for a
    terminal: in a JSON line those are escape sequences a log viewer shows or interprets (found
    by a docs walk-through)."""
    event.pop("color_message", None)
    return event


def capture_stdlib_logging(names: Iterable[str] = STDLIB_LOGGERS) -> None:
    """Route the standard-library loggers a kvguard server process runs (uvicorn's, Alembic's,
    SQLAlchemy's) through the same redaction and renderer as kvguard's own lines: JSON off a TTY,
    one object per line (issue 13, item 6). For server commands only: kvguard imported as a
    library (inside a vLLM engine) leaves the host's logging alone. Pass uvicorn `log_config=None`
    so that it installs no handlers of its own. A server logs at INFO (one access line per
    request) unless a level was given (`--log-level` / `KVGUARD_LOG_LEVEL`)."""
    if not _configured.get("explicit", False):
        configure_logging("INFO", json_output=_configured.get("json_output"), explicit=False)
    json_output, out = _configured["json_output"], _configured["out"]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            _component_from_logger,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.ExtraAdder(),
            _drop_terminal_copies,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            )
            if json_output
            else structlog.processors.format_exc_info,
            redact,
            renderer,
        ],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    level = logging.getLevelNamesMapping()[str(_configured["level"]).upper()]
    for name in names:
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
        logger.setLevel(max(level, logging.WARNING) if name in _QUIET else level)


# How a server process logs, for the worker processes it spawns (`kvguard serve --workers N`):
# they start from nothing and would otherwise log at WARNING, without the access lines.
SERVER_LOGGING_ENV: Final = "KVGUARD_SERVER_LOGGING"


def export_server_logging() -> None:
    """Put this server process's logging choice (after `capture_stdlib_logging`) in the
    environment its worker processes inherit."""
    setup = {"level": _configured["level"], "json_output": _configured["json_output"]}
    os.environ[SERVER_LOGGING_ENV] = json.dumps(setup)


def adopt_server_logging() -> None:
    """In a server's worker process: log as the parent server does (`export_server_logging`);
    nothing when it exported nothing."""
    raw = os.environ.get(SERVER_LOGGING_ENV)
    if not raw:
        return
    setup = json.loads(raw)
    configure_logging(str(setup["level"]), json_output=bool(setup["json_output"]))
    # uvicorn has configured the worker's loggers by now, its access logger off (`access_log`:
    # kvguard's own access line replaces it): capturing it again would log every request twice.
    capture_stdlib_logging(name for name in STDLIB_LOGGERS if name != "uvicorn.access")


def _component_from_logger(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> Any:
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("component", record.name)
    return event_dict


def get_logger(name: str) -> Any:
    """A structlog logger bound to a component name.

    If the process never called `configure_logging` (kvguard imported as a library, e.g. inside a vLLM
    engine), a redacting WARNING-level configuration is installed first: structlog's own default
    prints every level and has no redaction.
    """
    if not structlog.is_configured():
        configure_logging("WARNING")
    return structlog.get_logger(component=name)
