"""Command-line entry points of the audit ledger, as Typer apps for `kvguard.cli` to mount:

- `audit_app`: `kvguard audit export`, `kvguard audit checkpoint`, `kvguard audit verify-db`;
- `keys_app`: `kvguard keys signing-key NAME --out PATH` (checkpoint signing keys; named so that it
  cannot collide with the API keys of `kvguard keys create --role ...`) and `keys verifier-key`;
- `verify_command`: `kvguard verify`, the offline verifier (`kvguard.audit.verify_cli`).

Every command takes `--json` and follows the exit-code table of `kvguard.cli_output` (docs/cli.md):
0 ok, 1 the ledger is invalid or refuses (tampering, a rewritten log), 2 usage or environment (a
bad option, an unreadable key, a database it cannot open, a non-empty export directory).
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvguard.audit import note
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.cosign import WitnessKey
from kvguard.audit.notekey import NoteKey
from kvguard.audit.signing import SigningKey
from kvguard.audit.verify_cli import verify_command
from kvguard.audit.witness_client import CosignOutcome, WitnessEndpoint
from kvguard.audit.witness_client import Status as WitnessStatus
from kvguard.cli_output import EXIT_INVALID, EXIT_USAGE, JsonOpt, emit, fail, progress, reporting
from kvguard.errors import ConfigError, SecretFileError, VerificationError
from kvguard.secretfile import write_private_file

if TYPE_CHECKING:
    from kvguard.audit.ledger import Ledger

__all__ = ["audit_app", "keys_app", "parse_duration", "verify_command"]

audit_app = typer.Typer(help="Tamper-evident audit ledger: checkpoints, exports, verification.")
keys_app = typer.Typer(help="Key management.")

# One variable per setting, the same in every command (issue 13, item 8): the database is
# KVGUARD_DB_URL, the origin KVGUARD_LEDGER_ORIGIN, the signing key KVGUARD_SIGNING_KEY_FILE, with
# the defaults `kvguard serve` uses (kvguard.settings).
DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="KVGUARD_DB_URL",
        help="Database URL (sqlite:///... or postgresql+psycopg://...); default: the embedded "
        "SQLite file under KVGUARD_DATA_DIR",
        show_default=False,
    ),
]
OriginOpt = Annotated[
    str | None,
    typer.Option(
        "--origin",
        envvar="KVGUARD_LEDGER_ORIGIN",
        help="Log origin of the checkpoints; default: kvguard.local/ledger",
        show_default=False,
    ),
]
KeyFileOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--key",
        envvar="KVGUARD_SIGNING_KEY_FILE",
        help="Signing key file (0600); repeat during a rotation; default: ledger-signing.key "
        "under KVGUARD_DATA_DIR",
        show_default=False,
    ),
]
MinWitnessesOpt = Annotated[
    int | None,
    typer.Option(
        "--min-witnesses",
        min=0,
        help="Cosignatures needed for exit 0 (default: every --witness given)",
        show_default=False,
    ),
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


def _open(
    db: str | None,
    origin: str | None,
    key_files: list[Path] | None,
    witnesses: list[str] | None,
    json_output: bool,
    *,
    existing: bool = False,
) -> Ledger:
    """Open the ledger. `existing`: refuse (exit 2) a database that does not exist or holds no
    ledger, rather than create and migrate an empty one: `verify-db` and `export` must not
    answer "valid" about a ledger that moved or was deleted."""
    from kvguard.audit.ledger import Ledger  # noqa: PLC0415 - `kvguard verify` must not load SQL
    from kvguard.control.cli import resolve_db_url  # noqa: PLC0415
    from kvguard.settings import load_settings  # noqa: PLC0415

    settings = load_settings()
    # A database named with --db is never created here (a mistyped path signed a checkpoint of a
    # new, empty ledger); the embedded default is, on first use.
    db = resolve_db_url(db, existing=db is not None)
    origin = origin or settings.ledger_origin
    key_files = key_files or settings.signing_key_files()

    try:
        endpoints = [WitnessEndpoint.parse(w) for w in witnesses or ()]
    except (ValueError, VerificationError) as exc:
        raise fail(f"--witness: {exc}", EXIT_USAGE, json_output, label="usage error") from None
    keys = [SigningKey.load(p) for p in key_files]
    if existing:
        _require_ledger(db, json_output)
    return Ledger.open(db, origin=origin, signing_key=keys, witnesses=endpoints)


def _deliver_outbox(ledger: Ledger) -> int:
    """Append the operator changes waiting in the control outbox (keys made or revoked, purges
    queued on the command line) before signing: the admin API delivers them, and without a
    server running they never reached a checkpoint or an export, which read as complete (found
    by a review). A database without the control tables (a ledger of its own) has none. Returns
    how many were delivered."""
    import sqlalchemy as sa  # noqa: PLC0415 - `kvguard verify` must not load SQL

    from kvguard.control.outbox import Outbox  # noqa: PLC0415
    from kvguard.control.schema import OutboxRow  # noqa: PLC0415

    engine = ledger.store.engine
    if not sa.inspect(engine).has_table(OutboxRow.__tablename__):
        return 0
    return Outbox(engine).drain(ledger)


def _require_ledger(url: str, json_output: bool) -> None:
    """Fail (exit 2, naming the URL with its password masked) unless `url` names an existing
    database that holds the ledger's tables; creates nothing (SQLite makes a missing file on
    connect, so its path is checked first)."""
    import sqlalchemy as sa  # noqa: PLC0415 - `kvguard verify` must not load SQL

    from kvguard.audit import schema as t  # noqa: PLC0415
    from kvguard.audit.db import (  # noqa: PLC0415
        UNESCAPED_AT,
        create_engine,
        missing_sqlite_file,
        unescaped_at,
    )
    from kvguard.cli_output import connect_problem, safe_url  # noqa: PLC0415

    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        raise fail("--db: not a database URL", EXIT_USAGE, json_output) from None
    if unescaped_at(parsed):
        raise fail(f"--db: {UNESCAPED_AT}", EXIT_USAGE, json_output)

    where = safe_url(url)
    if missing_sqlite_file(parsed):
        raise fail(
            f"database {where} does not exist (nothing to verify or export; "
            "check --db / KVGUARD_DB_URL)",
            EXIT_USAGE,
            json_output,
        )
    # The ledger's own engine settings: on PostgreSQL a connect timeout and keepalives (a plain
    # engine waited forever on a server that accepts connections and never answers: a review).
    engine = create_engine(url)
    try:
        has_ledger = sa.inspect(engine).has_table(t.head.name)
    except sa.exc.SQLAlchemyError as exc:
        if isinstance(exc, sa.exc.OperationalError) and exc.statement is None:  # on connect
            message = f"{connect_problem(exc, url)} (check --db / KVGUARD_DB_URL)"
        else:
            message = (
                f"database {where} cannot be read ({type(exc).__name__}): check --db / "
                "KVGUARD_DB_URL and that the server is up"
            )
        raise fail(message, EXIT_USAGE, json_output) from None
    finally:
        engine.dispose()
    if not has_ledger:
        raise fail(
            f"database {where} holds no audit ledger (no {t.head.name} table): nothing to "
            "verify or export; check --db / KVGUARD_DB_URL, or run `kvguard db migrate` first",
            EXIT_USAGE,
            json_output,
        )


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


_MAX_DURATION_S = 100 * 365.25 * 86_400


def parse_duration(text: str) -> timedelta | None:
    """`90s`, `30m`, `24h`, `7d` or plain seconds; `0` means no limit (None)."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a duration like 90s, 30m, 24h or 7d") from None
    if not 0 <= seconds <= _MAX_DURATION_S:  # NaN, negative, or past what a timedelta holds
        raise ValueError(f"{text!r} is not a duration like 90s, 30m, 24h or 7d (at most 100 years)")
    return timedelta(seconds=seconds) if seconds else None


@audit_app.command("checkpoint")
def checkpoint_command(  # noqa: PLR0917 - Typer maps each parameter to one CLI option
    db: DbOpt = None,
    origin: OriginOpt = None,
    key: KeyFileOpt = None,
    witness: WitnessOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Also save it to this file (for `--trusted-checkpoint`)"),
    ] = None,
    min_witnesses: MinWitnessesOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Sign a checkpoint of the current log and print it (a C2SP signed note).

    The note carries the cosignatures of the witnesses given. Exit 0 signed (and cosigned by at
    least --min-witnesses); 1 refused (the log no longer extends its last checkpoint), or signed
    with fewer cosignatures (still printed and saved; each witness's outcome in the JSON and on
    stderr); 2 usage or environment (key file, database, --out, --min-witnesses above the
    witnesses given)."""
    needed = _witnesses_needed(witness, min_witnesses, json_output)
    with reporting(json_output, db_url=db):
        ledger = _open(db, origin, key, witness, json_output)
        try:
            delivered = _deliver_outbox(ledger)
            signed = ledger.checkpoint()
            outcome = ledger.last_cosigning
        finally:
            ledger.close()
        if out is not None:
            write_private_file(out, signed)  # evidence: 0600
    cp = parse_checkpoint(note.split_note(signed)[0])
    result: dict[str, Any] = {
        "checkpoint": signed,
        "origin": cp.origin,
        "tree_size": cp.size,
        "root": base64.b64encode(cp.root).decode(),
        "out": out,
        "delivered": delivered,
    }
    _finish_cosigned(result, outcome, needed, json_output, signed)


def _witnesses_needed(
    witness: list[str] | None, min_witnesses: int | None, json_output: bool
) -> int:
    """The cosignatures a command needs for exit 0: `--min-witnesses`, by default every
    `--witness` given; more than were given is a usage error."""
    needed = len(witness or []) if min_witnesses is None else min_witnesses
    if needed > len(witness or []):
        raise fail(
            f"--min-witnesses {needed} needs at least that many --witness", EXIT_USAGE, json_output
        )
    return needed


def _finish_cosigned(
    result: dict[str, Any],
    outcome: CosignOutcome | None,
    needed: int,
    json_output: bool,
    human: str,
) -> None:
    """Print `result` with each witness's outcome, and exit 1 when fewer than `needed` cosigned:
    what was signed (or exported) stands all the same, and the exit says the cosignatures asked
    for are missing (it said 0, and a witness down went unnoticed)."""
    outcomes = outcome.witnesses if outcome is not None else {}
    cosigned = outcome.cosigned if outcome is not None else []
    result["cosigned_by"] = cosigned
    result["witnesses"] = {
        n: {"status": str(o.status), "reason": o.reason} for n, o in outcomes.items()
    }
    error = f"{len(cosigned)} of the {needed} witness cosignatures needed"
    short = len(cosigned) < needed
    if short:
        result.update(error=error, exit_code=EXIT_INVALID)
    emit(result, json_output, human)
    if short:
        for name, got in sorted(outcomes.items()):
            if got.status is not WitnessStatus.OK:
                typer.echo(f"witness {name}: {got.status}: {got.reason}", err=True)
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(EXIT_INVALID)


@audit_app.command("export")
def export_command(  # noqa: PLR0917 - Typer maps each parameter to one CLI option
    out: Annotated[Path, typer.Option("--out", help="New or empty directory for the bundle")],
    db: DbOpt = None,
    origin: OriginOpt = None,
    key: KeyFileOpt = None,
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
    min_witnesses: MinWitnessesOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Export entries with inclusion proofs against a freshly signed checkpoint.

    With --witness the checkpoint is cosigned. Exit 0 exported; 1 the ledger fails a check on the
    way (nothing an auditor could not verify is written), or the checkpoint has fewer than
    --min-witnesses cosignatures (default: every --witness; the bundle is written all the same);
    2 usage or environment (key file, database, a non-empty --out). A progress bar shows when
    stderr is a terminal."""
    needed = _witnesses_needed(witness, min_witnesses, json_output)
    since = since.replace(tzinfo=since.tzinfo or UTC) if since else None
    until = until.replace(tzinfo=until.tzinfo or UTC) if until else None
    with reporting(json_output, db_url=db):
        ledger = _open(db, origin, key, witness, json_output, existing=True)
        try:
            delivered = _deliver_outbox(ledger)
            with progress("exporting", "entries", json_output=json_output) as update:
                summary = ledger.export(
                    out,
                    scope_tag=tenant,
                    since=since,
                    until=until,
                    tlog_proofs=tlog_proofs,
                    renderings=renderings,
                    progress=update,
                )
            outcome = ledger.last_cosigning
        finally:
            ledger.close()
    result: dict[str, Any] = {
        "path": summary.path,
        "tree_size": summary.tree_size,
        "entries": summary.entries,
        "complete": summary.complete,
        "checkpoint": summary.checkpoint,
        "delivered": delivered,
    }
    human = f"exported {summary.entries} entries of {summary.tree_size} to {summary.path}"
    _finish_cosigned(result, outcome, needed, json_output, human)


@audit_app.command("verify-db")
def verify_db_command(
    db: DbOpt = None,
    origin: OriginOpt = None,
    key: KeyFileOpt = None,
    max_unsigned_age: Annotated[
        str,
        typer.Option(
            envvar="KVGUARD_LEDGER_MAX_UNSIGNED_AGE",
            help="Fail when an entry older than this (e.g. 90s, 30m, 24h, 7d; 0: never) is "
            "covered by no checkpoint",
        ),
    ] = "24h",
    json_output: JsonOpt = False,
) -> None:
    """Recompute the whole ledger from the database (`Ledger.verify`).

    Exit 0 valid; 1 invalid (tampering, or entries unsigned for too long); 2 usage or
    environment. A progress bar shows when stderr is a terminal."""
    try:
        age = parse_duration(max_unsigned_age)
    except ValueError as exc:
        message = f"--max-unsigned-age: {exc}"
        raise fail(message, EXIT_USAGE, json_output, label="usage error") from None
    with reporting(json_output, db_url=db, invalid={"valid": False}):
        ledger = _open(db, origin, key, None, json_output, existing=True)
        try:
            with progress("verifying", "entries", json_output=json_output) as update:
                report = ledger.verify(max_unsigned_age=age, progress=update)
        finally:
            ledger.close()
    result = {
        "valid": True,
        "entries": report.size,
        "root": base64.b64encode(report.root).decode(),
        "checkpoints": report.checkpoints,
        "payloads": report.payloads,
        "erased_payloads": report.erased,
    }
    emit(result, json_output, f"valid: {report.size} entries, {report.checkpoints} checkpoints")


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
    json_output: JsonOpt = False,
) -> None:
    """Create a checkpoint signing key (0600) and print its verifier key.

    The file's path goes to stderr. Exit 0 ok; 2 the name is invalid or the file exists (never
    overwritten)."""
    create_note_key(SigningKey, name, out, "ledger-signing.key", json_output)


def create_note_key(
    kind: type[NoteKey], name: str, out: Path | None, default_file: str, json_output: bool
) -> None:
    """`kvguard keys signing-key` / `witness-key`: create the 0600 key (under KVGUARD_DATA_DIR
    when `out` is None, the path then said on stderr), print its verifier key."""
    from kvguard.settings import load_settings  # noqa: PLC0415 - `kvguard verify` stays light

    default = out is None
    with reporting(json_output, usage=(ValueError,)):
        out = out or load_settings().secret_path(default_file)
        key = kind.generate(name)
        key.save(out)
    if default:  # stdout stays the verifier key alone
        typer.echo(f"{kind.KIND} written to {out} (0600)", err=True)
    result = {"name": key.name, "path": out, "verifier_key": key.verifier_key()}
    emit(result, json_output, key.verifier_key())


def verifier_key_command(
    key_file: Annotated[
        Path,
        typer.Argument(
            help="A signing key file (`kvguard keys signing-key`) or a witness key file "
            "(`kvguard keys witness-key`)"
        ),
    ],
    json_output: JsonOpt = False,
) -> None:
    """Print the verifier key of a signing key (what auditors pass to `kvguard verify --key`) or of
    a witness key (what a log and auditors name the witness by).

    Exit 0 ok; 2 the file is missing, not 0600 or not a signing or witness key."""
    with reporting(json_output, usage=(ValueError,)):
        key: SigningKey | WitnessKey
        try:
            key = SigningKey.load(key_file)
        except SecretFileError:
            raise  # missing, or readable by others: that is the answer, whatever the key
        except ConfigError:
            try:  # a witness's key (it refused with "not a signing key (type 0x01)": a review)
                key = WitnessKey.load(key_file)
            except ConfigError:
                raise ConfigError(
                    f"{key_file}: neither a signing key (`kvguard keys signing-key`) nor a "
                    "witness key (`kvguard keys witness-key`)"
                ) from None
    result = {"name": key.name, "path": key_file, "verifier_key": key.verifier_key()}
    emit(result, json_output, key.verifier_key())
