"""Checkpoint signing keys (Ed25519, C2SP signed-note key type 0x01).

A `SigningKey` is the log's private identity. Its file form follows golang.org/x/mod/sumdb/note's
signer key encoding, `PRIVATE+KEY+<name>+<hex key ID>+<base64(0x01 || 32-byte seed)>`, so that Go
tooling can read it; files are created 0600 and refused when group- or world-readable
(`kvguard.secretfile`). The seed lives in a `bytearray` that `wipe()` overwrites, and is registered
with the log redactor so it never appears in a log line (G6).

Rotation: a ledger opened with several keys signs each checkpoint with all of them (one signature line
each), so auditors holding the old or the new verifier key both verify during the overlap.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvguard.audit import note
from kvguard.errors import ConfigError
from kvguard.logging import register_secret
from kvguard.secretfile import read_secret_file, write_secret_file

_FILE_PREFIX = "PRIVATE+KEY+"
_ED25519 = b"\x01"
_SEED_SIZE = 32


class SigningKey:
    """An Ed25519 checkpoint signing key with a signed-note key name."""

    def __init__(self, name: str, seed: bytes | bytearray) -> None:
        note.check_key_name(name)
        if len(seed) != _SEED_SIZE:
            raise ConfigError("an Ed25519 signing key seed is 32 bytes")
        self.name = name
        self._seed = bytearray(seed)
        register_secret(bytes(self._seed))
        self._private = Ed25519PrivateKey.from_private_bytes(bytes(self._seed))
        self.public_key: bytes = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.key_id: bytes = note.key_id(name, self.public_key)

    def __repr__(self) -> str:  # never the seed
        return f"SigningKey({self.name!r}, key_id={self.key_id.hex()})"

    @classmethod
    def generate(cls, name: str) -> SigningKey:
        raw = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return cls(name, raw)

    def verifier_key(self) -> str:
        """The public verifier key string an auditor passes to `kvguard verify --key`."""
        return note.verifier_key_string(self.name, self.public_key)

    def verifier(self) -> note.Verifier:
        return note.Verifier(self.name, self.key_id, self.public_key)

    def signature_line(self, text: str) -> str:
        """One signed-note signature line over `text` (which must end in a newline)."""
        note.check_text(text)
        return note.signature_line(self.name, self.key_id, self._private.sign(text.encode()))

    def encode(self) -> str:
        blob = base64.b64encode(_ED25519 + bytes(self._seed)).decode()
        return f"{_FILE_PREFIX}{self.name}+{self.key_id.hex()}+{blob}"

    @classmethod
    def decode(cls, text: str) -> SigningKey:
        if not text.startswith(_FILE_PREFIX):
            raise ConfigError("not a signed-note signer key (expected PRIVATE+KEY+...)")
        parts = text[len(_FILE_PREFIX) :].strip().split("+", 2)
        if len(parts) != 3:
            raise ConfigError("malformed signer key")
        name, hex_id, blob = parts
        try:
            raw = base64.b64decode(blob, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError("malformed signer key encoding") from None
        if len(raw) != 1 + _SEED_SIZE or raw[:1] != _ED25519:
            raise ConfigError("signer key is not an Ed25519 (type 0x01) key")
        key = cls(name, raw[1:])
        if key.key_id.hex() != hex_id:
            raise ConfigError("signer key ID does not match its key")
        return key

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the key to a new 0600 file (refuses to overwrite unless asked)."""
        return write_secret_file(path, (self.encode() + "\n").encode(), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path) -> SigningKey:
        """Read a key file after checking it is 0600 (SecretFileError otherwise)."""
        return cls.decode(read_secret_file(path).decode().strip())

    def wipe(self) -> None:
        """Overwrite the seed copy this object holds (the cryptography object keeps its own)."""
        for i in range(len(self._seed)):
            self._seed[i] = 0
