"""Command-line entry points of the audit ledger, as Typer apps for `kvguard.cli` to mount:

- `audit_app`: `kvguard audit export`, `kvguard audit checkpoint`, `kvguard audit verify-db`;
- `keys_app`: `kvguard keys signing-key NAME --out PATH` (checkpoint signing keys; named so that it
  cannot collide with the API keys of `kvguard keys create --role ...`);
- `verify_command`: `kvguard verify DIR --key VKEY [--key VKEY2] [--full]`, the offline verifier of
  export bundles, and `kvguard verify CERT.json --key VKEY` for erasure certificates
  (`kvguard.audit.certificate`). Exit codes: 0 valid, 1 invalid (the message names the first failing
  file, line and entry), 2 usage error.

The offline verification itself lives in `kvguard.audit.offline` and `kvguard.audit.certificate`
(cryptography + standard library); only the progress bar here uses rich.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kvguard.audit.certificate import load as load_certificate
from kvguard.audit.certificate import verify_certificate
from kvguard.audit.note import parse_verifier_key
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import KvguardError, VerificationError

if TYPE_CHECKING:
    from kvguard.audit.ledger import Ledger

EXIT_VALID, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

audit_app = typer.Typer(help="Tamper-evident audit ledger: checkpoints, exports, verification.")
keys_app = typer.Typer(help="Key management.")

DbOpt = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="KVGUARD_LEDGER_URL",
        help="Ledger database URL (sqlite:///... or postgresql+psycopg://...)",
    ),
]
OriginOpt = Annotated[
    str,
    typer.Option("--origin", envvar="KVGUARD_LEDGER_ORIGIN", help="Log origin of the checkpoints"),
]
KeyFileOpt = Annotated[
    list[Path], typer.Option("--key", help="Signing key file (0600); repeat during a rotation")
]


def _open(db: str, origin: str, key_files: list[Path]) -> Ledger:
    from kvguard.audit.ledger import Ledger  # noqa: PLC0415 - `kvguard verify` must not load SQL

    keys = [SigningKey.load(p) for p in key_files]
    return Ledger.open(db, origin=origin, signing_key=keys)


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


@audit_app.command("checkpoint")
def checkpoint_command(db: DbOpt, origin: OriginOpt, key: KeyFileOpt) -> None:
    """Sign a checkpoint of the current log and print it (a C2SP signed note)."""
    try:
        ledger = _open(db, origin, key)
        try:
            typer.echo(ledger.checkpoint(), nl=False)
        finally:
            ledger.close()
    except KvguardError as exc:
        raise _fail(f"error: {exc}", EXIT_INVALID) from None


@audit_app.command("export")
def export_command(  # noqa: PLR0917 - Typer maps each parameter to one CLI option
    db: DbOpt,
    origin: OriginOpt,
    key: KeyFileOpt,
    out: Annotated[Path, typer.Option("--out", help="New or empty directory for the bundle")],
    tenant: Annotated[str | None, typer.Option("--tenant", help="Tenant scope tag")] = None,
    since: Annotated[
        datetime | None, typer.Option(help="Earliest event time (UTC, inclusive)")
    ] = None,
    until: Annotated[
        datetime | None, typer.Option(help="Latest event time (UTC, exclusive)")
    ] = None,
    tlog_proofs: Annotated[
        bool, typer.Option("--tlog-proofs", help="Write proofs/*.tlog-proof")
    ] = False,
    renderings: Annotated[
        bool, typer.Option(help="Write entries.csv and entries.ocsf.jsonl")
    ] = True,
) -> None:
    """Export entries with inclusion proofs against a freshly signed checkpoint."""
    since = since.replace(tzinfo=since.tzinfo or UTC) if since else None
    until = until.replace(tzinfo=until.tzinfo or UTC) if until else None
    try:
        ledger = _open(db, origin, key)
        try:
            summary = ledger.export(
                out,
                scope_tag=tenant,
                since=since,
                until=until,
                tlog_proofs=tlog_proofs,
                renderings=renderings,
            )
        finally:
            ledger.close()
    except KvguardError as exc:
        raise _fail(f"error: {exc}", EXIT_INVALID) from None
    typer.echo(f"exported {summary.entries} entries of {summary.tree_size} to {summary.path}")


@audit_app.command("verify-db")
def verify_db_command(db: DbOpt, origin: OriginOpt, key: KeyFileOpt) -> None:
    """Recompute the whole ledger from the database (`Ledger.verify`)."""
    try:
        ledger = _open(db, origin, key)
        try:
            report = ledger.verify()
        finally:
            ledger.close()
    except VerificationError as exc:
        raise _fail(f"INVALID: {exc}", EXIT_INVALID) from None
    except KvguardError as exc:
        raise _fail(f"error: {exc}", EXIT_USAGE) from None
    typer.echo(f"valid: {report.size} entries, {report.checkpoints} checkpoints")


@keys_app.command("signing-key")
def signing_key_command(
    name: Annotated[
        str, typer.Argument(help="Key name, e.g. the log origin host: log.example.com")
    ],
    out: Annotated[Path, typer.Option("--out", help="Private key file to create (mode 0600)")],
) -> None:
    """Create a checkpoint signing key; print its verifier key for auditors."""
    try:
        key = SigningKey.generate(name)
        key.save(out)
    except (KvguardError, ValueError) as exc:
        raise _fail(f"error: {exc}", EXIT_USAGE) from None
    typer.echo(key.verifier_key())


def verifier_key_command(
    key_file: Annotated[
        Path, typer.Argument(help="A signing key file (`kvguard keys signing-key`)")
    ],
) -> None:
    """Print the verifier key of a signing key: what auditors pass to `kvguard verify --key`.
    Exit 0, or 2 when the file is missing, not 0600 or not a signing key."""
    try:
        key = SigningKey.load(key_file)
    except (KvguardError, ValueError, OSError) as exc:
        raise _fail(f"error: {exc}", EXIT_USAGE) from None
    typer.echo(key.verifier_key())


def verify_command(
    path: Annotated[
        Path, typer.Argument(help="Export bundle directory, or an erasure certificate file")
    ],
    key: Annotated[list[str], typer.Option("--key", help="Trusted verifier key (repeatable)")],
    full: Annotated[
        bool, typer.Option("--full", help="Complete export: recompute the root")
    ] = False,
    origin: Annotated[str | None, typer.Option(help="Expected log origin")] = None,
) -> None:
    """Verify an export bundle (a directory) or an erasure certificate (a file) offline.
    Exit 0 valid, 1 invalid, 2 usage error."""
    if not path.is_dir() and not path.is_file():
        raise _fail(f"usage error: {path} is neither a bundle directory nor a file", EXIT_USAGE)
    try:
        for k in key:
            parse_verifier_key(k)
    except VerificationError as exc:
        raise _fail(f"usage error: --key: {exc}", EXIT_USAGE) from None
    if path.is_file():
        if full:
            raise _fail("usage error: --full applies to export bundles only", EXIT_USAGE)
        _verify_certificate(path, key, origin)
    else:
        _verify_bundle(path, key, full, origin)


def _verify_certificate(path: Path, key: list[str], origin: str | None) -> None:
    try:
        report = verify_certificate(load_certificate(path), key, origin=origin)
    except VerificationError as exc:
        raise _fail(f"INVALID: {exc}", EXIT_INVALID) from None
    engines = f"{report.engines} engine{'' if report.engines == 1 else 's'}"
    typer.echo(
        f"valid: erasure certificate of purge job {report.job_id}: {report.blocks_cleared} blocks "
        f"cleared on {engines}, {report.entries} entries proven against checkpoint "
        f"{report.origin} size {report.tree_size}"
    )


def _verify_bundle(directory: Path, key: list[str], full: bool, origin: str | None) -> None:
    console = Console(stderr=True)
    columns = (
        TextColumn("verifying"),
        BarColumn(),
        TextColumn("{task.completed} entries"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("verify", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        try:
            report = verify_bundle(directory, key, full=full, progress=progress, origin=origin)
        except VerificationError as exc:
            raise _fail(f"INVALID: {exc}", EXIT_INVALID) from None
    typer.echo(
        f"valid: {report.entries} entries against checkpoint {report.origin} size "
        f"{report.tree_size}; {report.consistency_proofs} consistency proofs, "
        f"{report.tlog_proofs} tlog-proofs{'; root recomputed' if full else ''}"
    )
