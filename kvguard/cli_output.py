"""How every `kvguard` command reports: its result, its errors, its exit status, its progress.

One table of exit statuses (issue 13, item 5; documented in docs/cli.md):

- 0 (`EXIT_OK`): done, or the thing checked is valid;
- 1 (`EXIT_INVALID`): the command ran and the answer is no: a verification failed, a policy is
  invalid, the database shows tampering, the log was rewritten, the named tenant or key does not
  exist, the engines did not acknowledge in time;
- 2 (`EXIT_USAGE`): the command could not do its work: a bad option, a missing or unreadable file or
  key, a database it cannot open, a file it refuses to overwrite, a missing dependency.

The long-running servers (`kvguard serve`, `kvguard engine serve`, `kvguard witness serve`) map their
ends onto the same table (docs/operations.md, "Exit codes of the servers"): 0 stopped by SIGTERM or
SIGINT; 1 (`EXIT_FAILED`) the server failed while starting or running (a worker that cannot be
replaced, an engine core that died); 2 usage or environment, an address it cannot listen on
included.

With `--json`, stdout carries exactly one JSON object (sorted keys): the result, or on a non-zero
exit `{"error": ..., "exit_code": N}` plus whatever result fields the command had (a failed check
keeps `"valid": false`). Human messages go to stderr. Progress bars go to stderr, only when stderr is
a terminal and never with `--json`.

This module owns the formats, never what a command does; it never prints a secret of its own
accord (the one secret a command prints on purpose, a newly created key, is in its result).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kvguard.errors import (
    AppendOnlyViolationError,
    ConflictError,
    KvguardError,
    NotFoundError,
    PolicyValidationError,
    VerificationError,
)

EXIT_OK: Final = 0
EXIT_INVALID: Final = 1
EXIT_USAGE: Final = 2
EXIT_FAILED: Final = EXIT_INVALID  # a server failed at start-up or while running

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print the result (or the error) as one JSON object on stdout."),
]

ProgressFn = Callable[[int, int], None]

_MASK: Final = "***"
_PLACEHOLDER: Final = "kvguardmaskedsecret"
# Query parameters of a database URL whose value is a secret: libpq's `password` and `sslpassword`,
# and any driver's `*passwd*`, `*secret*` or `*token*` (a cloud IAM token, say). Masking a
# parameter that was not secret only costs a line of diagnosis.
SECRET_PARAMETER: Final = re.compile(r"passw|secret|token|credential", re.IGNORECASE)

# The errors that mean "the answer is no" (exit 1); every other expected error is a usage or
# environment problem (exit 2).
_INVALID: Final = (
    VerificationError,
    AppendOnlyViolationError,
    PolicyValidationError,
    NotFoundError,
    ConflictError,
)


def exit_code_for(exc: BaseException) -> int:
    """The table's status for an error a command reports."""
    return EXIT_INVALID if isinstance(exc, _INVALID) else EXIT_USAGE


def emit(result: Mapping[str, Any], json_output: bool, human: str) -> None:
    """Print a command's result: the JSON object with `--json`, else the human text (stdout)."""
    if json_output:
        typer.echo(_dumps(result))
    elif human:
        typer.echo(human.removesuffix("\n"))


def fail(
    message: str,
    code: int,
    json_output: bool = False,
    *,
    label: str = "error",
    result: Mapping[str, Any] | None = None,
) -> typer.Exit:
    """Report a non-zero outcome: `label: message` on stderr and, with `--json`, the result fields
    with `error` and `exit_code` on stdout. Returns the `typer.Exit` for the caller to raise."""
    typer.echo(f"{label}: {message}", err=True)
    if json_output:
        typer.echo(_dumps({**(result or {}), "error": message, "exit_code": code}))
    return typer.Exit(code)


@contextmanager
def reporting(
    json_output: bool,
    *,
    db_url: str | None = None,
    usage: tuple[type[Exception], ...] = (),
    invalid: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """Turn the errors a command expects into the table's status: kvguard's own errors by
    `exit_code_for`, an OSError or one of `usage` as 2, a database error as 2 (its type only: a
    driver's message may quote connection details or values; a failed connection says why,
    `connect_problem`). Anything else is a bug and propagates.
    `invalid`: result fields of the JSON error object when the answer is no (`{"valid": False}`)."""
    expected: tuple[type[Exception], ...] = (KvguardError, OSError, *usage)
    try:
        yield
    except (
        UnicodeEncodeError
    ):  # a lone surrogate: a byte of an argument that is not UTF-8 (Python's
        # stand-in for it), which no database driver can send
        raise fail(_NOT_TEXT, EXIT_USAGE, json_output) from None
    except expected as exc:
        code = exit_code_for(exc)
        label = "INVALID" if isinstance(exc, VerificationError) else "error"
        result = invalid if code == EXIT_INVALID else None
        raise fail(str(exc), code, json_output, label=label, result=result) from None
    except Exception as exc:
        if not _is_database_error(exc):
            raise
        raise fail(_database_problem(exc, db_url), EXIT_USAGE, json_output) from None


_NOT_TEXT = "an argument or option is not valid UTF-8 text"


def safe_url(url: str) -> str:
    """A database URL fit to print: the password masked, in the user information and in the query,
    where libpq (and docs/operations.md) take `password`, `sslpassword` and the like too."""
    from sqlalchemy.engine import make_url  # noqa: PLC0415 - `kvguard verify` must not load SQL
    from sqlalchemy.exc import ArgumentError  # noqa: PLC0415

    from kvguard.audit.db import unescaped_at  # noqa: PLC0415

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return "(malformed URL)"
    if unescaped_at(parsed):  # the password's tail would print as the host
        return "(malformed URL: an unescaped '@' in its user information)"
    masked = [name for name in parsed.query if SECRET_PARAMETER.search(name)]
    rendered = parsed.update_query_dict(dict.fromkeys(masked, _PLACEHOLDER))
    # The placeholder survives SQLAlchemy's quoting as it is, and reads as a mask once replaced.
    return rendered.render_as_string(hide_password=True).replace(_PLACEHOLDER, _MASK)


@contextmanager
def progress(description: str, unit: str, *, json_output: bool) -> Iterator[ProgressFn]:
    """A progress bar on stderr for long work; yields `update(done, total)` (total 0: unknown).
    Shown only when stderr is a terminal and `--json` is off: logs, pipes and CI stay clean."""
    console = Console(stderr=True)
    shown = not json_output and _is_tty(sys.stderr)
    columns = (
        TextColumn(description),
        BarColumn(),
        TextColumn(f"{{task.completed}} {unit}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, disable=not shown) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        yield update


def _is_tty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def _is_database_error(exc: BaseException) -> bool:
    # Checked without importing SQLAlchemy: if it is not loaded, no error can be one of its own.
    sa_exc = sys.modules.get("sqlalchemy.exc")
    return sa_exc is not None and isinstance(exc, sa_exc.SQLAlchemyError)


def _database_problem(exc: BaseException, db_url: str | None) -> str:
    """What a database error means for the operator, by its type only (a driver's message may quote
    connection details or the statement's values): a value the database refused, a schema that does
    not match this release, or a database that could not be reached (then why: `connect_problem`,
    whose message quotes no statement)."""
    import sqlalchemy.exc as sa_exc  # noqa: PLC0415 - loaded already: `exc` is one of its errors

    where = f" {safe_url(db_url)}" if db_url else ""
    kind = type(exc).__name__
    if isinstance(exc, sa_exc.DataError):
        return f"the database{where} refused a value as too long or malformed ({kind})"
    if isinstance(exc, sa_exc.IntegrityError):
        return f"the database{where} refused a change that conflicts with stored data ({kind})"
    if isinstance(exc, sa_exc.ProgrammingError):
        # A missing table or column, or a privilege the role lacks: the schema is not this
        # release's, most often because it was not migrated (the app role cannot migrate).
        return (
            f"the database{where} does not have this release's schema, or this role lacks a "
            f"privilege ({kind}): run `kvguard db migrate` as the owner role, then "
            "`kvguard db grants APP_ROLE` (docs/operations.md)"
        )
    if isinstance(exc, sa_exc.OperationalError) and exc.statement is None and db_url:
        return connect_problem(exc, db_url)
    return f"cannot open database{where}: {kind}"


def connect_problem(exc: BaseException, db_url: str) -> str:
    """Why a connection to `db_url` failed, for the operator: the server's own reason when it
    refused (`database "x" does not exist`, `password authentication failed for user "u"`), else
    the driver's (connection refused, a host that does not resolve), its first line. A connect
    error quotes no statement and no value; one that contains the URL's password or a secret query
    parameter anyway is withheld whole (masking each occurrence gave a short password away: with
    `a`, `d***t***b***se`). (It said "cannot be read (OperationalError)": a user with a mistyped
    database name could not tell it from a server that is down.)"""
    from sqlalchemy.engine import make_url  # noqa: PLC0415 - loaded already: `exc` is its error
    from sqlalchemy.exc import ArgumentError  # noqa: PLC0415

    where = safe_url(db_url)
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__]
    # libpq: `connection failed: connection to server at "h", port p failed: FATAL:  <reason>`
    reason = lines[0].rpartition(" failed: ")[2].strip() or lines[0]
    server = ""
    try:
        parsed = make_url(db_url)
    except (ArgumentError, ValueError):
        pass
    else:
        secrets = [str(parsed.password)] if parsed.password else []
        for name, value in parsed.query.items():
            if SECRET_PARAMETER.search(name):
                secrets += [value] if isinstance(value, str) else list(value)
        if any(secret and secret in reason for secret in secrets):
            reason = "the driver's reason is withheld: it contains a secret of the URL"
        if parsed.host:
            server = f"the server at {parsed.host}" + (f":{parsed.port}" if parsed.port else "")
    before, fatal, told = reason.partition("FATAL:")
    if fatal and not before.strip():
        refused = f"{server or 'the server'} refused the connection"
        return f"cannot open database {where}: {refused}: {told.strip()}"
    if server:
        return f"cannot open database {where}: no connection to {server}: {reason}"
    return f"cannot open database {where}: {reason}"  # a file (SQLite) or a local socket


def _dumps(result: Mapping[str, Any]) -> str:
    return json.dumps(result, indent=2, sort_keys=True, default=_plain)


def _plain(value: object) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
