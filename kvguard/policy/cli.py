"""`kvguard policy ...`: policy commands (mounted by kvguard.cli as `policy_app`).

`validate FILE...` prints `OK <file>` for each valid file and `<file>: <field path>: <message>` for each
problem of an invalid one, all on stdout so the output can be piped and grepped; with `--json`, one
object with every file's problems. Exit status (`kvguard.cli_output`, docs/cli.md): 0 when every file
is valid, 1 when any is invalid, 2 for usage errors, which includes a file that does not exist, is a
directory or cannot be read (checked before any file is parsed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from kvguard.cli_output import EXIT_INVALID, EXIT_USAGE, JsonOpt, emit, fail
from kvguard.errors import PolicyValidationError
from kvguard.policy.loading import load_policy_file

policy_app = typer.Typer(
    name="policy", help="Validate and inspect retention and sharing policies.", no_args_is_help=True
)


@policy_app.callback()
def _policy() -> None:
    """Validate and inspect retention and sharing policies."""
    # A callback keeps `validate` a subcommand even while it is the only one (typer would otherwise
    # promote a lone command to the app itself, and `kvguard policy validate` would break).


def _check_readable(files: list[Path], json_output: bool) -> None:
    """A path that is not a readable file is a mistake in the command, not in a policy: exit 2
    before anything is parsed."""
    for path in files:
        if not path.is_file():
            problem = "is a directory" if path.is_dir() else "does not exist"
            raise fail(f"{path} {problem}", EXIT_USAGE, json_output, label="usage error")
        if not os.access(path, os.R_OK):
            raise fail(f"{path} is not readable", EXIT_USAGE, json_output, label="usage error")


def _problems(exc: PolicyValidationError) -> list[dict[str, str]]:
    return [{"field": field, "message": message} for field, message in exc.problems]


@policy_app.command("validate")
def validate(
    files: Annotated[
        list[Path], typer.Argument(help="Policy files (YAML, or JSON when named *.json).")
    ],
    json_output: JsonOpt = False,
) -> None:
    """Check policy files; report every problem with its field path.

    Exit 0 all valid; 1 any invalid; 2 usage (a missing, unreadable or directory path)."""
    _check_readable(files, json_output)
    results: list[dict[str, Any]] = []
    lines = []
    for path in files:
        try:
            load_policy_file(path)
        except PolicyValidationError as exc:
            results.append({"file": path, "valid": False, "problems": _problems(exc)})
            lines += [f"{path}: {field}: {message}" for field, message in exc.problems]
        else:
            results.append({"file": path, "valid": True, "problems": []})
            lines.append(f"OK {path}")
    invalid = sum(not r["valid"] for r in results)
    result = {"valid": not invalid, "files": results}
    if invalid and json_output:
        message = f"{invalid} of {len(files)} policy files invalid"
        raise fail(message, EXIT_INVALID, json_output, result=result)
    emit(result, json_output, "\n".join(lines))
    if invalid:
        raise typer.Exit(EXIT_INVALID)


@policy_app.command("digest")
def digest(
    file: Annotated[Path, typer.Argument(help="A policy file.")],
    json_output: JsonOpt = False,
) -> None:
    """Print the digest of the file's canonical JSON (what the store and the ledger record).

    Exit 0 ok; 1 the policy is invalid; 2 usage (a missing or unreadable path)."""
    _check_readable([file], json_output)
    try:
        policy_set = load_policy_file(file)
    except PolicyValidationError as exc:
        if json_output:
            result = {"file": file, "valid": False, "problems": _problems(exc)}
            raise fail(f"{file} is not a valid policy", EXIT_INVALID, True, result=result) from None
        for field, message in exc.problems:
            typer.echo(f"{file}: {field}: {message}")
        raise typer.Exit(EXIT_INVALID) from None
    emit({"file": file, "digest": policy_set.digest()}, json_output, policy_set.digest())
