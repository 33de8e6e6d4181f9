"""Pure functions behind the dashboard's views: policy text diffs, who signed a checkpoint, whether a
certificate verifies. No I/O, no request: the views pass in what they read through the API's own
route functions, so these are tested directly and fast.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

from kvguard.audit import cosign, note
from kvguard.audit.certificate import verify_certificate
from kvguard.audit.cosign import WitnessVerifier
from kvguard.errors import VerificationError
from kvguard.policy import PolicySet

_DIFF_CONTEXT: Final = 3


def format_ts(seconds: float | None) -> str:
    """A Unix time as UTC, to the second (`2026-11-26 04:11:52Z`); an em dash for none."""
    if seconds is None:
        return "\u2014"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def policy_text(policy: PolicySet) -> str:
    """The policy's canonical JSON (sorted keys, every default spelled out), one field per line:
    what the diff compares, and what the store form is filled with."""
    return json.dumps(json.loads(policy.canonical_json()), indent=2, sort_keys=True) + "\n"


class LineKind(StrEnum):
    FILE = "file"  # `--- version 3` / `+++ version 4`
    HUNK = "hunk"  # `@@ -1,4 +1,4 @@`
    REMOVED = "removed"
    ADDED = "added"
    CONTEXT = "context"


@dataclass(frozen=True, slots=True)
class DiffLine:
    kind: LineKind
    text: str


def text_diff(old: str, new: str, *, old_name: str, new_name: str) -> list[DiffLine]:
    """A unified diff (difflib) of two texts, each line classified for display; empty when equal."""
    lines = difflib.unified_diff(
        old.splitlines(),
        new.splitlines(),
        fromfile=old_name,
        tofile=new_name,
        n=_DIFF_CONTEXT,
        lineterm="",
    )
    return [DiffLine(_kind(line), line) for line in lines]


def _kind(line: str) -> LineKind:
    if line.startswith(("--- ", "+++ ")):
        return LineKind.FILE
    if line.startswith("@@"):
        return LineKind.HUNK
    if line.startswith("-"):
        return LineKind.REMOVED
    if line.startswith("+"):
        return LineKind.ADDED
    return LineKind.CONTEXT


class SignerRole(StrEnum):
    LOG = "log"  # one of this ledger's own signing keys
    WITNESS = "witness"  # a configured witness whose cosignature verified
    INVALID = "invalid"  # a configured witness whose line does not verify
    UNKNOWN = "unknown"  # a key nobody configured here: shown, not checked


@dataclass(frozen=True, slots=True)
class Signer:
    name: str
    role: SignerRole
    cosigned_at: float | None = None  # a witness's cosignature timestamp


def checkpoint_signers(
    signed_note: str,
    log_keys: Sequence[note.Verifier],
    witnesses: Sequence[WitnessVerifier],
) -> list[Signer]:
    """Every signature line of a checkpoint note: the log's own (checked with `note.open_note`),
    each configured witness's cosignature (checked with `kvguard.audit.cosign`), the rest reported
    unchecked. A note that does not parse raises VerificationError."""
    text, lines = note.split_note(signed_note)
    log_ids = {(k.name, k.key_id) for k in log_keys}
    try:
        verified = {(k.name, k.key_id) for k in note.open_note(signed_note, log_keys)[1]}
    except VerificationError:
        verified = set()
    by_id = {(w.name, w.key_id): w for w in witnesses}
    signers: list[Signer] = []
    for name, raw in lines:
        kid = raw[:4]
        if (name, kid) in log_ids:
            role = SignerRole.LOG if (name, kid) in verified else SignerRole.INVALID
            signers.append(Signer(name, role))
            continue
        witness = by_id.get((name, kid))
        if witness is None:
            signers.append(Signer(name, SignerRole.UNKNOWN))
            continue
        try:
            stamp = cosign.verify_cosignature(text, raw, witness)
        except VerificationError:
            signers.append(Signer(name, SignerRole.INVALID))
        else:
            signers.append(Signer(name, SignerRole.WITNESS, float(stamp)))
    return signers


def missing_witnesses(signers: Iterable[Signer], witnesses: Iterable[WitnessVerifier]) -> list[str]:
    """Configured witnesses with no valid cosignature among `signers`."""
    cosigned = {s.name for s in signers if s.role is SignerRole.WITNESS}
    return sorted({w.name for w in witnesses} - cosigned)


@dataclass(frozen=True, slots=True)
class Verification:
    valid: bool
    detail: str


def verify(document: Mapping[str, Any], verifier_keys: Sequence[str], origin: str) -> Verification:
    """`verify_certificate` (the offline verifier `kvguard verify` runs) as a displayable result."""
    try:
        report = verify_certificate(document, verifier_keys, origin=origin)
    except VerificationError as exc:
        return Verification(False, str(exc))
    return Verification(
        True,
        f"ledger entries proven: {report.entries}, against the signed checkpoint of tree size "
        f"{report.tree_size}; blocks cleared: {report.blocks_cleared}; engines: {report.engines}",
    )
