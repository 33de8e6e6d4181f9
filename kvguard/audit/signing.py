"""Checkpoint signing keys (Ed25519, C2SP signed-note key type 0x01).

A `SigningKey` is the log's private identity: a `kvguard.audit.notekey.NoteKey` of type 0x01. Its
file form follows golang.org/x/mod/sumdb/note's signer key encoding,
`PRIVATE+KEY+<name>+<hex key ID>+<base64(0x01 || 32-byte seed)>`, so that Go tooling can read it;
files are created 0600 and refused when group- or world-readable (`kvguard.secretfile`). The seed
lives in a `bytearray` that `wipe()` overwrites, and is registered with the log redactor so it never
appears in a log line (G6).

Rotation: a ledger opened with several keys signs each checkpoint with all of them (one signature line
each), so auditors holding the old or the new verifier key both verify during the overlap.
"""

from __future__ import annotations

from typing import ClassVar

from kvguard.audit import note
from kvguard.audit.notekey import NoteKey


class SigningKey(NoteKey):
    """An Ed25519 checkpoint signing key with a signed-note key name."""

    SIG_TYPE: ClassVar[bytes] = note.ED25519
    KIND: ClassVar[str] = "signing key"

    def verifier(self) -> note.Verifier:
        return note.Verifier(self.name, self.key_id, self.public_key)

    def signature_line(self, text: str) -> str:
        """One signed-note signature line over `text` (which must end in a newline)."""
        note.check_text(text)
        return note.signature_line(self.name, self.key_id, self._sign(text.encode()))
