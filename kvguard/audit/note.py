"""C2SP signed notes with Ed25519 (c2sp.org/signed-note), as small pure functions.

A signed note is: the text (non-empty, UTF-8, ending in a newline), one blank line, then signature
lines `— <key name> <base64(key ID || signature)>\\n` (U+2014 EM DASH). The signature covers the text
including its final newline. For Ed25519 (signature type 0x01) the key ID is the first 4 bytes of
SHA-256(key name || 0x0A || 0x01 || 32-byte public key) and the verifier key string is
`<name>+<hex key ID>+<base64(0x01 || public key)>`.

The text may contain blank lines: it ends at the *last* blank line of the note (spec, "Format"),
as golang.org/x/mod/sumdb/note splits it. Verification (`open_note`) fails closed: unknown signers
are ignored as the spec requires, but at least one known key must have signed and every known key's
signature present must verify; a repeated line of a known key after its first is ignored, as Go's
`note.Open` does (the first one decides). This module depends only on `cryptography` and the standard library: the
offline verifier imports it.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvguard.audit.checkpoint import b64decode_strict
from kvguard.errors import VerificationError

ED25519 = b"\x01"  # signed-note signature type for Ed25519
COSIGNATURE_V1 = b"\x04"  # timestamped Ed25519 witness cosignatures (c2sp.org/tlog-cosignature)
_TYPE_NAMES = {ED25519: "Ed25519 (type 0x01)", COSIGNATURE_V1: "Ed25519 cosignature/v1 (type 0x04)"}
_SIG_PREFIX = "\u2014 "  # EM DASH, space
_KEY_ID_SIZE = 4
_MAX_SIGNATURES = 100


class Verifier(NamedTuple):
    """A parsed verifier key: the public half a relying party trusts."""

    name: str
    key_id: bytes
    public_key: bytes  # the raw 32-byte Ed25519 key


def check_key_name(name: str) -> None:
    """Key names are non-empty and contain no whitespace and no `+` (signed-note, "Signatures")."""
    if not name or "+" in name or any(c.isspace() for c in name) or not name.isprintable():
        raise ValueError(f"invalid signed-note key name {name!r}")


def key_id(name: str, public_key: bytes, sig_type: bytes = ED25519) -> bytes:
    """First 4 bytes of SHA-256(name || 0x0A || signature type || public key)."""
    return hashlib.sha256(name.encode() + b"\n" + sig_type + public_key).digest()[:_KEY_ID_SIZE]


def verifier_key_string(name: str, public_key: bytes, sig_type: bytes = ED25519) -> str:
    """`<name>+<hex key ID>+<base64(signature type || public key)>`."""
    check_key_name(name)
    blob = base64.b64encode(sig_type + public_key).decode()
    return f"{name}+{key_id(name, public_key, sig_type).hex()}+{blob}"


def parse_verifier_key(
    vkey: str, sig_type: bytes = ED25519, what: str = "verifier key"
) -> Verifier:
    """Parse and check a verifier key string of `sig_type`; raises VerificationError (naming
    `what`) if it is malformed or of another type."""
    parts = vkey.strip().split("+", 2)  # base64 may itself contain "+"
    if len(parts) != 3:
        raise VerificationError(f"{what} must have the form name+keyid+base64key")
    name, hex_id, blob = parts
    try:
        check_key_name(name)
        claimed_id = bytes.fromhex(hex_id)
    except ValueError:
        raise VerificationError(f"{what} has an invalid name or key ID") from None
    raw = b64decode_strict(blob, what)
    if len(raw) != 33 or raw[:1] != sig_type:
        raise VerificationError(f"{what} is not an {_TYPE_NAMES.get(sig_type, 'Ed25519')} key")
    if key_id(name, raw[1:], sig_type) != claimed_id or len(hex_id) != 8:
        raise VerificationError(f"{what} ID does not match its name and public key")
    return Verifier(name, claimed_id, raw[1:])


def signature_line(name: str, kid: bytes, signature: bytes) -> str:
    return f"{_SIG_PREFIX}{name} {base64.b64encode(kid + signature).decode()}\n"


def check_text(text: str) -> None:
    """Note text is non-empty, ends in a newline and holds no control characters but newlines
    (blank lines are allowed: spec, "Format")."""
    if not text.endswith("\n") or text == "\n":
        raise ValueError("note text must be non-empty and end with a newline")
    if _has_control(text):
        raise ValueError("note text may not contain control characters other than newline")


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 and c != "\n" for c in text)


def split_note(note: str) -> tuple[str, list[tuple[str, bytes]]]:
    """Split a signed note into its text and its (key name, key ID || signature) lines."""
    if _has_control(note):  # the whole note, signature lines included (spec, "Format")
        raise VerificationError("signed note contains control characters other than newline")
    head, sep, sigs = note.rpartition("\n\n")  # the text ends at the last blank line
    if not sep or not sigs.endswith("\n") or not head:
        raise VerificationError("signed note has no signature block after a non-empty text")
    text = head + "\n"
    lines = sigs[:-1].split("\n")
    if len(lines) > _MAX_SIGNATURES:
        raise VerificationError("too many signature lines")
    out: list[tuple[str, bytes]] = []
    for line in lines:
        if not line.startswith(_SIG_PREFIX):
            raise VerificationError("malformed signature line (must start with an em dash)")
        name, space, blob = line[len(_SIG_PREFIX) :].partition(" ")
        raw = b64decode_strict(blob, "signature") if space else b""
        if not name or len(raw) <= _KEY_ID_SIZE or " " in blob:
            raise VerificationError("malformed signature line")
        out.append((name, raw))
    return text, out


def open_note(note: str, verifiers: Iterable[Verifier]) -> tuple[str, list[Verifier]]:
    """Verify `note` against trusted `verifiers`; return its text and the keys that signed it.

    Raises VerificationError when no trusted key signed or when a trusted key's (first) signature
    is bad. Later lines of a key already seen are ignored, as Go's `note.Open` does.
    """
    trusted = {(v.name, v.key_id): v for v in verifiers}
    text, sigs = split_note(note)
    signed: list[Verifier] = []
    for name, raw in sigs:
        verifier = trusted.get((name, raw[:_KEY_ID_SIZE]))
        if verifier is None:
            continue  # a signature by a key we do not know (a witness, an old key): ignore it
        if verifier in signed:
            continue  # the first line of this key decided
        try:
            Ed25519PublicKey.from_public_bytes(verifier.public_key).verify(
                raw[_KEY_ID_SIZE:], text.encode()
            )
        except InvalidSignature:
            raise VerificationError(f"signature by {name} does not verify") from None
        signed.append(verifier)
    if not signed:
        raise VerificationError("note is not signed by any trusted key")
    return text, signed


def signed_by_any(note: str, verifiers: Iterable[Verifier]) -> bool:
    """Whether any signature line of `note` claims one of `verifiers`' keys (not checked here:
    `open_note` checks it). False for a note signed only by keys the caller does not hold."""
    known = {(v.name, v.key_id) for v in verifiers}
    return any((name, raw[:_KEY_ID_SIZE]) in known for name, raw in split_note(note)[1])


def join_note(text: str, lines: Sequence[str]) -> str:
    """Assemble a signed note from its text and signature lines."""
    check_text(text)
    if not lines:
        raise ValueError("a signed note needs at least one signature")
    return text + "\n" + "".join(lines)
