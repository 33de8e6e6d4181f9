"""`NoteKey`: an Ed25519 private key with a signed-note key name, for every kind kvguard holds.

The log's checkpoint signing key (`kvguard.audit.signing.SigningKey`, signature type 0x01) and a
witness's cosigning key (`kvguard.audit.cosign.WitnessKey`, type 0x04) differ only in their type
byte (which enters the key ID and the key strings) and in what they sign; this class is the rest.

File form, golang.org/x/mod/sumdb/note's signer key encoding with the key's type byte:
`PRIVATE+KEY+<name>+<hex key ID>+<base64(type || 32-byte seed)>`, created 0600 and refused when
group- or world-readable (`kvguard.secretfile`). The seed lives in a `bytearray` that `wipe()`
overwrites, is registered with the log redactor (G6), and never appears in `repr` or an error.

Module level needs only `cryptography` and the standard library: the offline verifier imports
`kvguard.audit.cosign`, which subclasses this; the secret-file and logging helpers, which only key
holders need, are imported when used.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import ClassVar, Self

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvguard.audit import note
from kvguard.errors import ConfigError

_FILE_PREFIX = "PRIVATE+KEY+"
_SEED_SIZE = 32


class NoteKey:
    """See the module docstring. Subclasses set `SIG_TYPE` and `KIND` (a noun for messages)."""

    SIG_TYPE: ClassVar[bytes]
    KIND: ClassVar[str]

    def __init__(self, name: str, seed: bytes | bytearray) -> None:
        note.check_key_name(name)
        if len(seed) != _SEED_SIZE:
            raise ConfigError(f"an Ed25519 {self.KIND} seed is 32 bytes")
        from kvguard.logging import register_secret  # noqa: PLC0415 - keep verifiers light

        self.name = name
        self._seed = bytearray(seed)
        register_secret(bytes(self._seed))  # masked in every log line (G6)
        self._private = Ed25519PrivateKey.from_private_bytes(bytes(self._seed))
        self.public_key: bytes = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.key_id: bytes = note.key_id(name, self.public_key, self.SIG_TYPE)

    def __repr__(self) -> str:  # never the seed
        return f"{type(self).__name__}({self.name!r}, key_id={self.key_id.hex()})"

    @classmethod
    def generate(cls, name: str) -> Self:
        raw = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return cls(name, raw)

    def verifier_key(self) -> str:
        """The public verifier key string (`name+hexkeyid+base64(type || public key)`)."""
        return note.verifier_key_string(self.name, self.public_key, self.SIG_TYPE)

    def _sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def encode(self) -> str:
        blob = base64.b64encode(self.SIG_TYPE + bytes(self._seed)).decode()
        return f"{_FILE_PREFIX}{self.name}+{self.key_id.hex()}+{blob}"

    @classmethod
    def decode(cls, text: str) -> Self:
        kind = cls.KIND
        if not text.startswith(_FILE_PREFIX):
            raise ConfigError(f"not a {kind} file (expected PRIVATE+KEY+...)")
        parts = text[len(_FILE_PREFIX) :].strip().split("+", 2)
        if len(parts) != 3:
            raise ConfigError(f"malformed {kind}")
        name, hex_id, blob = parts
        try:
            raw = base64.b64decode(blob, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"malformed {kind} encoding") from None
        if len(raw) != 1 + _SEED_SIZE or raw[:1] != cls.SIG_TYPE:
            raise ConfigError(f"not an Ed25519 {kind} (signature type 0x{cls.SIG_TYPE.hex()})")
        try:
            key = cls(name, raw[1:])
        except ValueError:
            raise ConfigError(f"{kind} has an invalid key name") from None
        if key.key_id.hex() != hex_id:
            raise ConfigError(f"{kind} ID does not match its key")
        return key

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the key to a new 0600 file (refuses to overwrite unless asked)."""
        from kvguard.secretfile import write_secret_file  # noqa: PLC0415 - keep verifiers light

        return write_secret_file(path, (self.encode() + "\n").encode(), overwrite=overwrite)

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read a key file after checking it is 0600 (SecretFileError otherwise)."""
        from kvguard.secretfile import read_secret_file  # noqa: PLC0415 - keep verifiers light

        try:
            text = read_secret_file(path).decode()
        except UnicodeDecodeError:  # its bytes are not echoed: they are the key's
            raise ConfigError(
                f"{Path(path).name}: not a {cls.KIND} key file (not UTF-8 text)"
            ) from None
        return cls.decode(text.strip())

    def wipe(self) -> None:
        """Overwrite the seed copy this object holds (the cryptography object keeps its own)."""
        for i in range(len(self._seed)):
            self._seed[i] = 0
