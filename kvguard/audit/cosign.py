"""Witness cosignatures on checkpoints (c2sp.org/tlog-cosignature, Ed25519 `cosignature/v1`).

A cosignature is a signed-note signature line (c2sp.org/signed-note) that a *witness* adds to a log's
checkpoint after checking it is consistent with every earlier checkpoint of that log it saw
(c2sp.org/tlog-witness). It sits in the same signature block as the log's own signature lines.

tlog-cosignature, "Format" and "Ed25519 signed message":

- signature type 0x04 (signed-note, "Signature types"); key ID =
  SHA-256(name || 0x0A || 0x04 || 32-byte Ed25519 public key)[:4];
- the line's blob is key ID || timestamp (u64, big-endian, POSIX seconds, at most 2^63 - 1) ||
  Ed25519 signature (64 bytes);
- the signed message is `cosignature/v1\\n`, `time <timestamp>\\n`, then the whole checkpoint body;
- the verifier key is `<name>+<hex key ID>+<base64(0x04 || public key)>`.

The Ed25519 message does not commit to the witness name, so one public key trusted under two names
would let one signature count as two witnesses: `require_cosignatures` refuses such a configuration.

Like `kvguard.audit.note`, verification depends only on `cryptography` and the standard library (the
offline verifier imports this module); `WitnessKey`, which only a witness builds, imports
`kvguard.secretfile` and the log redactor lazily.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvguard.audit import note
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.notekey import NoteKey
from kvguard.errors import ConfigError, VerificationError

_HEADER = "cosignature/v1\n"  # domain separation (tlog-cosignature, "Ed25519 signed message")
_KEY_ID_SIZE = 4
_TIMESTAMP_SIZE = 8
_SIGNATURE_SIZE = 64
_BLOB_SIZE = _KEY_ID_SIZE + _TIMESTAMP_SIZE + _SIGNATURE_SIZE
_MAX_TIMESTAMP = 2**63 - 1  # tlog-cosignature: "It MUST NOT exceed 2^63 - 1"


class WitnessVerifier(NamedTuple):
    """A witness's public identity as a relying party trusts it."""

    name: str
    key_id: bytes
    public_key: bytes  # the raw 32-byte Ed25519 key


class Cosignature(NamedTuple):
    """A verified cosignature: which witness, and the time it vouched for the checkpoint."""

    name: str
    timestamp: int


def witness_key_id(name: str, public_key: bytes) -> bytes:
    """SHA-256(name || 0x0A || 0x04 || public key)[:4] (tlog-cosignature, "Format")."""
    return note.key_id(name, public_key, note.COSIGNATURE_V1)


def witness_verifier_key_string(name: str, public_key: bytes) -> str:
    """`<name>+<hex key ID>+<base64(0x04 || public key)>` (signed-note, "Verifier keys")."""
    return note.verifier_key_string(name, public_key, note.COSIGNATURE_V1)


def parse_witness_verifier_key(vkey: str) -> WitnessVerifier:
    """Parse a witness verifier key (type 0x04); raises VerificationError if it is malformed."""
    return WitnessVerifier(
        *note.parse_verifier_key(vkey, note.COSIGNATURE_V1, what="witness verifier key")
    )


def cosigned_message(checkpoint_text: str, timestamp: int) -> bytes:
    """The bytes a cosignature/v1 signs: header line, time line, checkpoint body."""
    _check_timestamp(timestamp)
    return f"{_HEADER}time {timestamp}\n{checkpoint_text}".encode()


def _check_timestamp(timestamp: int) -> None:
    if not 0 <= timestamp <= _MAX_TIMESTAMP:
        raise ValueError(f"cosignature timestamp {timestamp} is out of range")


def _checkpoint_text(text: str) -> str:
    """Only well-formed checkpoints are cosigned or checked (tlog-checkpoint)."""
    parse_checkpoint(text)
    return text


def verify_cosignature(checkpoint_text: str, blob: bytes, verifier: WitnessVerifier) -> int:
    """Check one signature-line blob by `verifier` over `checkpoint_text`; return its timestamp."""
    if len(blob) != _BLOB_SIZE or blob[:_KEY_ID_SIZE] != verifier.key_id:
        raise VerificationError(f"cosignature by {verifier.name} is malformed")
    timestamp = int.from_bytes(blob[_KEY_ID_SIZE : _KEY_ID_SIZE + _TIMESTAMP_SIZE], "big")
    if timestamp > _MAX_TIMESTAMP:
        raise VerificationError(f"cosignature by {verifier.name} has an out-of-range timestamp")
    message = cosigned_message(checkpoint_text, timestamp)
    try:
        Ed25519PublicKey.from_public_bytes(verifier.public_key).verify(
            blob[_KEY_ID_SIZE + _TIMESTAMP_SIZE :], message
        )
    except InvalidSignature:
        raise VerificationError(f"cosignature by {verifier.name} does not verify") from None
    return timestamp


def cosignatures(
    signed_note: str, witness_verifiers: Iterable[WitnessVerifier]
) -> list[Cosignature]:
    """The valid cosignatures by `witness_verifiers` on the note's checkpoint, in note order.

    Signature lines of unknown keys (the log's own, other witnesses) are ignored, as signed-note
    requires; a known witness's line that does not verify raises VerificationError (fail closed,
    like `note.open_note`), and later lines of a key already seen are ignored, as there and in Go's
    `note.Open`. The log's own signature is not checked
    here: open the note with the log's verifier key (`note.open_note`) as well.
    """
    trusted = {(v.name, v.key_id): v for v in witness_verifiers}
    text, sigs = note.split_note(signed_note)
    _checkpoint_text(text)
    found: list[Cosignature] = []
    seen: set[tuple[str, bytes]] = set()
    for name, raw in sigs:
        verifier = trusted.get((name, raw[:_KEY_ID_SIZE]))
        if verifier is None:
            continue
        if (name, verifier.key_id) in seen:
            continue  # the first line of this key decided (as `note.open_note` and Go do)
        seen.add((name, verifier.key_id))
        found.append(Cosignature(name, verify_cosignature(text, raw, verifier)))
    return found


def require_cosignatures(
    signed_note: str, witness_vkeys: Sequence[str], min_witnesses: int
) -> list[str]:
    """Raise VerificationError unless at least `min_witnesses` distinct trusted witnesses cosigned.

    Returns the names of the witnesses whose cosignatures verified. Witnesses are counted by name,
    so a witness trusted under two keys (a rotation) counts once. ConfigError when the policy can
    never be met or when one public key is trusted under two names (see the module docstring).
    """
    verifiers = [parse_witness_verifier_key(v) for v in witness_vkeys]
    names = {v.name for v in verifiers}
    owners: dict[bytes, str] = {}
    for v in verifiers:
        if owners.setdefault(v.public_key, v.name) != v.name:
            raise ConfigError(f"witnesses {owners[v.public_key]} and {v.name} share a public key")
    if not 1 <= min_witnesses <= len(names):
        raise ConfigError(
            f"cannot require {min_witnesses} witness cosignatures from {len(names)} trusted witnesses"
        )
    cosigned = sorted({c.name for c in cosignatures(signed_note, verifiers)})
    if len(cosigned) < min_witnesses:
        missing = ", ".join(sorted(names - set(cosigned))) or "none"
        raise VerificationError(
            f"only {len(cosigned)} of the {min_witnesses} required witness cosignatures are "
            f"present and valid (missing: {missing})"
        )
    return cosigned


class WitnessKey(NoteKey):
    """A witness's private Ed25519 cosigning key with its signed-note key name: a
    `kvguard.audit.notekey.NoteKey` of type 0x04 (file form
    `PRIVATE+KEY+<name>+<hex key ID>+<base64(0x04 || 32-byte seed)>`, created 0600)."""

    SIG_TYPE: ClassVar[bytes] = note.COSIGNATURE_V1
    KIND: ClassVar[str] = "witness key"

    def verifier(self) -> WitnessVerifier:
        return WitnessVerifier(self.name, self.key_id, self.public_key)

    def cosignature_line(self, checkpoint_text: str, timestamp: int) -> str:
        """One signed-note signature line cosigning `checkpoint_text` at `timestamp` (POSIX s)."""
        if timestamp <= 0:  # tlog-witness: "the timestamp MUST NOT be zero"
            raise ValueError("a witness cosignature needs a positive timestamp")
        signature = self._sign(cosigned_message(_checkpoint_text(checkpoint_text), timestamp))
        return note.signature_line(
            self.name, self.key_id, timestamp.to_bytes(_TIMESTAMP_SIZE, "big") + signature
        )
