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

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NamedTuple

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kvguard.audit import bundle
from kvguard.audit.certificate import get_path, verify_certificate
from kvguard.audit.certificate import load as load_certificate
from kvguard.audit.cosign import parse_witness_verifier_key, require_cosignatures
from kvguard.audit.note import parse_verifier_key
from kvguard.audit.offline import OriginNotPinnedError, expected_origin, verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.audit.witness_client import WitnessEndpoint
from kvguard.errors import ConfigError, KvguardError, VerificationError

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
WitnessOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--witness",
        envvar="KVGUARD_LEDGER_WITNESSES",
        help="A c2sp.org/tlog-witness to cosign the checkpoint, as URL=VERIFIER_KEY (repeatable)",
        show_default=False,
    ),
]


def _open(db: str, origin: str, key_files: list[Path], witnesses: list[str] | None) -> Ledger:
    from kvguard.audit.ledger import Ledger  # noqa: PLC0415 - `kvguard verify` must not load SQL

    try:
        endpoints = [WitnessEndpoint.parse(w) for w in witnesses or ()]
    except (ValueError, VerificationError) as exc:
        raise _fail(f"usage error: --witness: {exc}", EXIT_USAGE) from None
    keys = [SigningKey.load(p) for p in key_files]
    return Ledger.open(db, origin=origin, signing_key=keys, witnesses=endpoints)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta | None:
    """`90s`, `30m`, `24h`, `7d` or plain seconds; `0` means no limit (None)."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a duration like 90s, 30m, 24h or 7d") from None
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"{text!r} is not a duration like 90s, 30m, 24h or 7d")
    return timedelta(seconds=seconds) if seconds else None


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


@audit_app.command("checkpoint")
def checkpoint_command(
    db: DbOpt,
    origin: OriginOpt,
    key: KeyFileOpt,
    witness: WitnessOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Also save it to this file (for `--trusted-checkpoint`)"),
    ] = None,
) -> None:
    """Sign a checkpoint of the current log and print it (a C2SP signed note, with the
    cosignatures of the witnesses given)."""
    try:
        ledger = _open(db, origin, key, witness)
        try:
            signed = ledger.checkpoint()
        finally:
            ledger.close()
        if out is not None:
            out.write_text(signed, encoding="utf-8")
    except (KvguardError, OSError) as exc:
        raise _fail(f"error: {exc}", EXIT_INVALID) from None
    typer.echo(signed, nl=False)


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
    witness: WitnessOpt = None,
    payloads: Annotated[
        bool,
        typer.Option(
            "--payloads",
            help="Include the erasable payloads (personal data) so the verifier opens their "
            "commitments; by default the bundle only states they are present",
        ),
    ] = False,
) -> None:
    """Export entries with inclusion proofs against a freshly signed (and, with --witness,
    cosigned) checkpoint."""
    since = since.replace(tzinfo=since.tzinfo or UTC) if since else None
    until = until.replace(tzinfo=until.tzinfo or UTC) if until else None
    try:
        ledger = _open(db, origin, key, witness)
        try:
            summary = ledger.export(
                out,
                scope_tag=tenant,
                since=since,
                until=until,
                tlog_proofs=tlog_proofs,
                renderings=renderings,
                include_payloads=payloads,
            )
        finally:
            ledger.close()
    except KvguardError as exc:
        raise _fail(f"error: {exc}", EXIT_INVALID) from None
    typer.echo(f"exported {summary.entries} entries of {summary.tree_size} to {summary.path}")


@audit_app.command("verify-db")
def verify_db_command(
    db: DbOpt,
    origin: OriginOpt,
    key: KeyFileOpt,
    max_unsigned_age: Annotated[
        str,
        typer.Option(
            envvar="KVGUARD_LEDGER_MAX_UNSIGNED_AGE",
            help="Fail when an entry older than this (e.g. 90s, 30m, 24h, 7d; 0: never) is "
            "covered by no checkpoint",
        ),
    ] = "24h",
) -> None:
    """Recompute the whole ledger from the database (`Ledger.verify`)."""
    try:
        age = parse_duration(max_unsigned_age)
    except ValueError as exc:
        raise _fail(f"usage error: --max-unsigned-age: {exc}", EXIT_USAGE) from None
    try:
        ledger = _open(db, origin, key, None)
        try:
            report = ledger.verify(max_unsigned_age=age)
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
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Private key file to create (mode 0600); default: ledger-signing.key in "
            "KVGUARD_DATA_DIR",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Create a checkpoint signing key; print its verifier key for auditors (the file's path goes
    to stderr)."""
    from kvguard.settings import Settings  # noqa: PLC0415 - `kvguard verify` stays light

    default = out is None
    out = out or Settings().secret_path("ledger-signing.key")
    try:
        key = SigningKey.generate(name)
        key.save(out)
    except (KvguardError, ValueError) as exc:
        raise _fail(f"error: {exc}", EXIT_USAGE) from None
    if default:  # say where it went (stderr: stdout stays the verifier key alone)
        typer.echo(f"signing key written to {out} (0600)", err=True)
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


def verify_command(  # noqa: PLR0917 - Typer maps each parameter to one CLI option
    path: Annotated[
        Path, typer.Argument(help="Export bundle directory, or an erasure certificate file")
    ],
    key: Annotated[list[str], typer.Option("--key", help="Trusted verifier key (repeatable)")],
    full: Annotated[
        bool, typer.Option("--full", help="Complete export: recompute the root")
    ] = False,
    origin: Annotated[
        str | None,
        typer.Option(
            help="Expected log origin (required unless a trusted checkpoint or the key names "
            "pin it)"
        ),
    ] = None,
    trusted_checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--trusted-checkpoint",
            help="A checkpoint you kept earlier: the bundle must prove its log extends it",
        ),
    ] = None,
    save_checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--save-checkpoint",
            help="After a valid result, save the bundle's checkpoint here for later pinning",
        ),
    ] = None,
    witness_key: Annotated[
        list[str] | None,
        typer.Option("--witness-key", help="Trusted witness verifier key (repeatable)"),
    ] = None,
    min_witnesses: Annotated[
        int | None,
        typer.Option(
            "--min-witnesses", min=1, help="Cosignatures required (default: one per witness key)"
        ),
    ] = None,
) -> None:
    """Verify an export bundle (a directory) or an erasure certificate (a file) offline.
    Exit 0 valid, 1 invalid, 2 usage error."""
    if not path.is_dir() and not path.is_file():
        raise _fail(f"usage error: {path} is neither a bundle directory nor a file", EXIT_USAGE)
    witnesses = list(witness_key or [])
    try:
        for k in key:
            parse_verifier_key(k)
        for w in witnesses:
            parse_witness_verifier_key(w)
    except VerificationError as exc:
        raise _fail(f"usage error: --key / --witness-key: {exc}", EXIT_USAGE) from None
    if min_witnesses is not None and min_witnesses > len(witnesses):
        raise _fail(
            f"usage error: --min-witnesses {min_witnesses} needs as many --witness-key", EXIT_USAGE
        )
    pinned = _read_pinned(trusted_checkpoint)
    trust = _Trust(key, origin, pinned, witnesses, min_witnesses or len(witnesses))
    if path.is_file():
        if full:
            raise _fail("usage error: --full applies to export bundles only", EXIT_USAGE)
        checkpoint = _verify_certificate(path, trust)
    else:
        checkpoint = _verify_bundle(path, trust, full)
    if save_checkpoint is not None:
        _save_checkpoint(save_checkpoint, checkpoint)


class _Trust(NamedTuple):
    keys: list[str]
    origin: str | None
    pinned: str | None
    witnesses: list[str]
    min_witnesses: int


def _read_pinned(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        message = f"usage error: --trusted-checkpoint: cannot read {path}: {exc}"
        raise _fail(message, EXIT_USAGE) from None


def _save_checkpoint(path: Path, checkpoint: str) -> None:
    """Write the verified checkpoint for `--trusted-checkpoint` next time (replacing an older
    one the auditor kept is the point, so an existing file is overwritten)."""
    try:
        path.write_text(checkpoint, encoding="utf-8")
    except OSError as exc:
        raise _fail(f"error: --save-checkpoint: {exc}", EXIT_USAGE) from None
    typer.echo(f"checkpoint saved to {path} (pass it as --trusted-checkpoint next time)")


def _check_witnesses(checkpoint: str, trust: _Trust) -> str:
    if not trust.witnesses:
        return ""
    try:
        names = require_cosignatures(checkpoint, trust.witnesses, trust.min_witnesses)
    except ConfigError as exc:
        raise _fail(f"usage error: --witness-key: {exc}", EXIT_USAGE) from None
    return f"; cosigned by {len(names)} witness{'es' if len(names) != 1 else ''}"


def _verify_certificate(path: Path, trust: _Trust) -> str:
    try:
        document = load_certificate(path)
        report = verify_certificate(document, trust.keys, origin=trust.origin)
        verifiers = [parse_verifier_key(k) for k in trust.keys]
        expected_origin(report.origin, trust.origin, None, verifiers)
        checkpoint = str(get_path(document, "evidence.checkpoint"))
        if trust.pinned is not None:
            raise VerificationError(
                "--trusted-checkpoint applies to export bundles (a certificate carries no "
                "consistency proofs)"
            )
        witnessed = _check_witnesses(checkpoint, trust)
    except OriginNotPinnedError as exc:
        raise _fail(f"usage error: {exc}", EXIT_USAGE) from None
    except VerificationError as exc:
        raise _fail(f"INVALID: {exc}", EXIT_INVALID) from None
    engines = f"{report.engines} engine{'' if report.engines == 1 else 's'}"
    typer.echo(
        f"valid: erasure certificate of purge job {report.job_id}: {report.blocks_cleared} blocks "
        f"cleared on {engines}, {report.entries} entries proven against checkpoint "
        f"{report.origin} size {report.tree_size}{witnessed}"
    )
    return checkpoint


def _verify_bundle(directory: Path, trust: _Trust, full: bool) -> str:
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
            report = verify_bundle(
                directory,
                trust.keys,
                full=full,
                progress=progress,
                origin=trust.origin,
                trusted_checkpoint=trust.pinned,
            )
            checkpoint = (directory / bundle.CHECKPOINT).read_text(encoding="utf-8")
            witnessed = _check_witnesses(checkpoint, trust)
        except OriginNotPinnedError as exc:
            raise _fail(f"usage error: {exc}", EXIT_USAGE) from None
        except VerificationError as exc:
            raise _fail(f"INVALID: {exc}", EXIT_INVALID) from None
    pinned = (
        f"; extends your trusted checkpoint of size {report.pinned_size}"
        if report.pinned_size is not None
        else ""
    )
    selection = "complete log" if report.complete else "filtered"
    typer.echo(
        f"valid: {report.entries} entries ({selection}) against checkpoint of origin "
        f"{report.origin!r} size {report.tree_size}; {report.consistency_proofs} consistency "
        f"proofs, {report.tlog_proofs} tlog-proofs, {report.payloads} payloads present "
        f"({report.opened_payloads} opened), {report.erased_payloads} erased{pinned}{witnessed}"
        f"{'; root recomputed' if full else ''}"
    )
    return checkpoint
