"""`kvguard verify`: the offline verifier of export bundles (a directory) and erasure certificates
(a JSON file), mounted by `kvguard.cli`.

`kvguard verify DIR --key VKEY [--key VKEY2] [--full]` checks a bundle (`kvguard.audit.offline`);
`kvguard verify CERT.json --key VKEY` checks a certificate (`kvguard.audit.certificate`). Exit codes
(kvguard.cli_output): 0 valid, 1 invalid (the message names the first failing file, line and
entry), 2 usage error. The verification itself needs only cryptography and the standard library;
this module adds Typer and the progress bar, never SQL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer

from kvguard.audit.certificate import get_path, verify_certificate
from kvguard.audit.certificate import load as load_certificate
from kvguard.audit.cosign import parse_witness_verifier_key, require_cosignatures
from kvguard.audit.note import parse_verifier_key
from kvguard.audit.offline import OriginNotPinnedError, expected_origin, verify_bundle
from kvguard.cli_output import EXIT_INVALID, EXIT_USAGE, JsonOpt, emit, fail, progress
from kvguard.errors import ConfigError, VerificationError


class _Trust(NamedTuple):
    keys: list[str]
    origin: str | None
    pinned: str | None
    witnesses: list[str]
    min_witnesses: int


class _Outcome(NamedTuple):
    checkpoint: str
    result: dict[str, Any]
    human: str


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
    json_output: JsonOpt = False,
) -> None:
    """Verify an export bundle (a directory) or an erasure certificate (a file) offline.

    Exit 0 valid; 1 invalid; 2 usage error. A progress bar shows when stderr is a terminal."""
    kind = "certificate" if path.is_file() else "bundle"
    if not path.is_dir() and not path.is_file():
        raise _usage(f"{path} is neither a bundle directory nor a file", json_output)
    witnesses = list(witness_key or [])
    try:
        for k in key:
            parse_verifier_key(k)
        for w in witnesses:
            parse_witness_verifier_key(w)
    except VerificationError as exc:
        raise _usage(f"--key / --witness-key: {exc}", json_output) from None
    if min_witnesses is not None and min_witnesses > len(witnesses):
        raise _usage(f"--min-witnesses {min_witnesses} needs as many --witness-key", json_output)
    if kind == "certificate" and full:
        raise _usage("--full applies to export bundles only", json_output)
    if kind == "certificate" and trusted_checkpoint is not None:
        raise _usage(
            "--trusted-checkpoint applies to export bundles (a certificate carries no "
            "consistency proofs)",
            json_output,
        )
    pinned = _read_pinned(trusted_checkpoint, json_output)
    trust = _Trust(key, origin, pinned, witnesses, min_witnesses or len(witnesses))
    try:
        if kind == "certificate":
            outcome = _verify_certificate(path, trust)
        else:
            outcome = _verify_bundle(path, trust, full, json_output)
    except (OriginNotPinnedError, ConfigError) as exc:
        raise _usage(str(exc), json_output) from None
    except VerificationError as exc:
        result = {"valid": False, "kind": kind}
        raise fail(str(exc), EXIT_INVALID, json_output, label="INVALID", result=result) from None
    result, human = {**outcome.result, "saved_checkpoint": None}, outcome.human
    if save_checkpoint is not None:
        _save_checkpoint(save_checkpoint, outcome.checkpoint, json_output)
        result["saved_checkpoint"] = save_checkpoint
        human += (
            f"\ncheckpoint saved to {save_checkpoint} (pass it as --trusted-checkpoint next time)"
        )
    emit(result, json_output, human)


def _usage(message: str, json_output: bool) -> typer.Exit:
    return fail(message, EXIT_USAGE, json_output, label="usage error")


_MAX_CHECKPOINT = 1 << 20  # a signed note with many cosignatures is a few KiB


def _read_pinned(path: Path | None, json_output: bool) -> str | None:
    if path is None:
        return None
    try:
        if not path.is_file():  # a FIFO would block, /dev/zero would never end
            raise _usage(f"--trusted-checkpoint: {path} is not a regular file", json_output)
        with path.open("rb") as f:
            raw = f.read(_MAX_CHECKPOINT + 1)
        if len(raw) > _MAX_CHECKPOINT:
            message = f"--trusted-checkpoint: {path} is larger than any checkpoint"
            raise _usage(message, json_output)
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _usage(f"--trusted-checkpoint: cannot read {path}: {exc}", json_output) from None


def _save_checkpoint(path: Path, checkpoint: str, json_output: bool) -> None:
    """Write the verified checkpoint for `--trusted-checkpoint` next time (replacing an older
    one the auditor kept is the point, so an existing file is overwritten)."""
    try:
        from kvguard.secretfile import write_private_file  # noqa: PLC0415 - verify stays light

        write_private_file(path, checkpoint)  # evidence: 0600
    except (OSError, ConfigError) as exc:
        raise fail(f"--save-checkpoint: {exc}", EXIT_USAGE, json_output) from None


def _check_witnesses(checkpoint: str, trust: _Trust) -> list[str]:
    """The trusted witnesses that cosigned (VerificationError below the minimum; ConfigError when
    the witness options can never be met: a usage error)."""
    if not trust.witnesses:
        return []
    try:
        return require_cosignatures(checkpoint, trust.witnesses, trust.min_witnesses)
    except ConfigError as exc:
        raise ConfigError(f"--witness-key: {exc}") from None


def _witnessed(names: list[str]) -> str:
    if not names:
        return ""
    return f"; cosigned by {len(names)} witness{'es' if len(names) != 1 else ''}"


def _verify_certificate(path: Path, trust: _Trust) -> _Outcome:
    document = load_certificate(path)
    report = verify_certificate(document, trust.keys, origin=trust.origin)
    verifiers = [parse_verifier_key(k) for k in trust.keys]
    expected_origin(report.origin, trust.origin, None, verifiers)
    checkpoint = str(get_path(document, "evidence.checkpoint"))
    cosigned = _check_witnesses(checkpoint, trust)
    engines = f"{report.engines} engine{'' if report.engines == 1 else 's'}"
    keys = report.offload_keys_destroyed
    shredded = f", {keys} offload data key{'' if keys == 1 else 's'} destroyed" if keys else ""
    human = (
        f"valid: erasure certificate of purge job {report.job_id}: {report.blocks_cleared} blocks "
        f"cleared on {engines}{shredded}, {report.entries} entries proven against checkpoint "
        f"{report.origin} size {report.tree_size}{_witnessed(cosigned)}"
    )
    result = {
        "valid": True,
        "kind": "certificate",
        "job_id": report.job_id,
        "origin": report.origin,
        "tree_size": report.tree_size,
        "entries": report.entries,
        "engines": report.engines,
        "blocks_cleared": report.blocks_cleared,
        "offload_keys_destroyed": report.offload_keys_destroyed,
        "cosigned_by": cosigned,
    }
    return _Outcome(checkpoint, result, human)


def _selection_filters(selection: str) -> dict[str, Any] | None:
    """The filters of a filtered bundle's selection (None: the complete log)."""
    _, _, body = selection.partition(" ")
    if not body:
        return None
    try:
        filters = json.loads(body)
    except ValueError:
        return {"unparsed": selection}
    return filters if isinstance(filters, dict) else {"unparsed": selection}


def _verify_bundle(directory: Path, trust: _Trust, full: bool, json_output: bool) -> _Outcome:
    with progress("verifying", "entries", json_output=json_output) as update:
        report = verify_bundle(
            directory,
            trust.keys,
            full=full,
            progress=update,
            origin=trust.origin,
            trusted_checkpoint=trust.pinned,
        )
        checkpoint = report.checkpoint_note  # the note verified, not the file read again
        cosigned = _check_witnesses(checkpoint, trust)
    pinned = (
        f"; extends your trusted checkpoint of size {report.pinned_size}"
        if report.pinned_size is not None
        else ""
    )
    # A filtered bundle says which filters the signed manifest records: an auditor must see that
    # entries outside them are absent by selection, not proven absent from the log.
    selection = (
        "complete log"
        if report.complete
        else "".join(c if c.isprintable() else "?" for c in report.selection)
    )
    human = (
        f"valid: {report.entries} entries ({selection}) against checkpoint of origin "
        f"{report.origin!r} size {report.tree_size}; {report.consistency_proofs} consistency "
        f"proofs, {report.tlog_proofs} tlog-proofs, {report.payloads} payloads present, "
        f"{report.erased_payloads} erased{pinned}"
        f"{_witnessed(cosigned)}{'; root recomputed' if full else ''}{_foreign(report.foreign)}"
        f"{_CSV_LEGACY if report.csv_legacy else ''}"
    )
    result = {
        "valid": True,
        "kind": "bundle",
        "origin": report.origin,
        "tree_size": report.tree_size,
        "entries": report.entries,
        "complete": report.complete,
        "selection": _selection_filters(report.selection),
        "root_recomputed": full,
        "consistency_proofs": report.consistency_proofs,
        "tlog_proofs": report.tlog_proofs,
        "payloads": report.payloads,
        "erased_payloads": report.erased_payloads,
        "pinned_size": report.pinned_size,
        "cosigned_by": cosigned,
        "foreign_entries": list(report.foreign),
        "csv_legacy": report.csv_legacy,
    }
    return _Outcome(checkpoint, result, human)


# A bundle exported before the CSV cells were neutralised (docs/audit.md, the entries.csv row):
# valid evidence, but its CSV may hold a cell a spreadsheet runs as a formula.
_CSV_LEGACY = (
    "\nWARNING: entries.csv predates CSV-injection neutralisation (a cell may start with = + - @ "
    "and run as a formula): do not open it in a spreadsheet; use entries.jsonl or re-export"
)


def _foreign(indices: tuple[int, ...]) -> str:
    """The warning for entries that are not kvguard events: the log proves they are in it, but
    something other than kvguard wrote them (docs/audit.md, Append guards)."""
    if not indices:
        return ""
    shown = ", ".join(map(str, indices[:10])) + (", ..." if len(indices) > 10 else "")
    return (
        f"\nWARNING: {len(indices)} entries are not kvguard events (written into the log by "
        f"something other than kvguard, e.g. a database role holding INSERT): {shown}"
    )
