"""`kvguard policy ...`: policy commands (mounted by kvguard.cli as `policy_app`).

`validate FILE...` prints `OK <file>` for each valid file and `<file>: <field path>: <message>` for each
problem of an invalid one, all on stdout so the output can be piped and grepped. Exit status: 0 when
every file is valid, 1 when any is invalid, 2 for usage errors, which includes a file that does not exist
or is a directory (typer checks the paths before any file is read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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


@policy_app.command("validate")
def validate(
    files: Annotated[
        list[Path],
        typer.Argument(
            exists=True, dir_okay=False, help="Policy files (YAML, or JSON when named *.json)."
        ),
    ],
) -> None:
    """Check policy files; report every problem with its field path."""
    invalid = False
    for path in files:
        try:
            load_policy_file(path)
        except PolicyValidationError as exc:
            invalid = True
            for field, message in exc.problems:
                typer.echo(f"{path}: {field}: {message}")
        else:
            typer.echo(f"OK {path}")
    if invalid:
        raise typer.Exit(code=1)


@policy_app.command("digest")
def digest(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A policy file.")],
) -> None:
    """Print the digest of the file's canonical JSON (what the store and the ledger record)."""
    try:
        policy_set = load_policy_file(file)
    except PolicyValidationError as exc:
        for field, message in exc.problems:
            typer.echo(f"{file}: {field}: {message}")
        raise typer.Exit(code=1) from None
    typer.echo(policy_set.digest())
