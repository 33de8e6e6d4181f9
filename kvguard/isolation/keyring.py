"""The server-side secrets that salts and scope tags are derived from.

A keyring holds one or more salt keys by key id, names the active one (used for every new salt), and
pins the key that scope tags derive from. Tags are public pseudonyms stored in the ledger; pinning their
key means rotating the salt key (which deliberately ends all reuse of earlier blocks) does not change
the pseudonym of a tenant, so audit queries keep working across rotations.

Keys are held in `bytearray` so `wipe()` can overwrite them (pyca habit); they are registered with the
log redactor on load and never appear in `repr`.

File format (JSON, mode 0600): {"active": "k2", "tag_kid": "k1", "keys": {"k1": "<base64>", ...}}.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NewType

from kvguard.errors import ConfigError, UnknownKeyError
from kvguard.logging import register_secret
from kvguard.secretfile import read_secret_file, write_secret_file

KeyId = NewType("KeyId", str)

MIN_KEY_BYTES: Final = 32
_KID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


def _check_kid(kid: str) -> KeyId:
    if not _KID_RE.fullmatch(kid):
        # The id is not echoed: in a hand-edited file it may be a key pasted into the wrong place.
        raise ConfigError("a key id is invalid: use 1-32 characters from A-Z a-z 0-9 _ -")
    return KeyId(kid)


class Keyring:
    """Salt keys by id, the active one, and the pinned tag key."""

    __slots__ = ("_active", "_keys", "_tag_kid")

    def __init__(
        self, keys: Mapping[str, bytes | bytearray], active: str, tag_kid: str | None = None
    ):
        if not keys:
            raise ConfigError("keyring is empty: at least one salt key is required")
        self._keys: dict[KeyId, bytearray] = {}
        for kid, secret in keys.items():
            if len(secret) < MIN_KEY_BYTES:
                # Never the key id: a pasted key may sit where an id belongs (see `_check_kid`).
                raise ConfigError(
                    f"a salt key is {len(secret)} bytes; at least {MIN_KEY_BYTES} required"
                )
            self._keys[_check_kid(kid)] = bytearray(secret)
            register_secret(bytes(secret))
        self._active = _check_kid(active)
        if self._active not in self._keys:
            raise ConfigError(f"active key id {active!r} is not in the keyring")
        self._tag_kid = _check_kid(tag_kid) if tag_kid is not None else min(self._keys)
        if self._tag_kid not in self._keys:
            raise ConfigError(f"tag key id {tag_kid!r} is not in the keyring")

    def __repr__(self) -> str:
        return f"Keyring(kids={sorted(self._keys)}, active={self._active!r}, tag_kid={self._tag_kid!r})"

    @property
    def active(self) -> KeyId:
        return self._active

    @property
    def tag_kid(self) -> KeyId:
        return self._tag_kid

    @property
    def kids(self) -> list[KeyId]:
        return sorted(self._keys)

    def secret(self, kid: str) -> bytes:
        """The key bytes for `kid`; raises UnknownKeyError for a key id not in the keyring."""
        try:
            return bytes(self._keys[KeyId(kid)])
        except KeyError:
            raise UnknownKeyError(f"key id {kid!r} is not in the keyring") from None

    @classmethod
    def generate(cls, kid: str = "k1") -> Keyring:
        """A fresh keyring with one random 32-byte key."""
        return cls({kid: secrets.token_bytes(MIN_KEY_BYTES)}, active=kid)

    def rotated(self, new_kid: str, new_secret: bytes | None = None) -> Keyring:
        """A keyring with a new active key; older keys stay for reference, the tag key stays pinned."""
        if new_kid in self._keys:
            raise ConfigError(f"key id {new_kid!r} already exists in the keyring")
        keys: dict[str, bytes | bytearray] = {str(k): v for k, v in self._keys.items()}
        keys[new_kid] = new_secret if new_secret is not None else secrets.token_bytes(MIN_KEY_BYTES)
        return Keyring(keys, active=new_kid, tag_kid=self._tag_kid)

    def wipe(self) -> None:
        """Overwrite every key in memory; the keyring is unusable afterwards."""
        for buf in self._keys.values():
            buf[:] = bytes(len(buf))
        self._keys.clear()

    # --- persistence -------------------------------------------------------------------------

    def to_json(self) -> bytes:
        keys = {kid: base64.b64encode(bytes(v)).decode() for kid, v in sorted(self._keys.items())}
        doc = {"active": self._active, "tag_kid": self._tag_kid, "keys": keys}
        return json.dumps(doc, indent=2).encode() + b"\n"

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        return write_secret_file(path, self.to_json(), overwrite=overwrite)

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "keyring") -> Keyring:
        try:
            doc = json.loads(data, object_pairs_hook=_unique)
            keys = {str(k): base64.b64decode(v, validate=True) for k, v in doc["keys"].items()}
            active = str(doc["active"])
            tag_kid = doc.get("tag_kid")
        except _RepeatedKeyError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as exc:
            # The exception text could quote key material: report only its type.
            raise ConfigError(
                f"{source}: not a kvguard keyring (expected JSON with 'active' and base64 'keys'; "
                f"{type(exc).__name__})"
            ) from None
        return cls(keys, active=active, tag_kid=None if tag_kid is None else str(tag_kid))

    @classmethod
    def load(cls, path: str | Path) -> Keyring:
        """Load a keyring file after checking it is readable by its owner only."""
        return cls.from_json(read_secret_file(path), source=str(path))


class _RepeatedKeyError(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are all distinct: a hand-merged keyring naming a key id (or
    `active`) twice would lose one of them silently, and the next rotation would write the file
    back without it (found by a review). Refused naming the position, never a name or a value."""
    out: dict[str, Any] = {}
    for position, (name, value) in enumerate(pairs, start=1):
        if name in out:
            raise _RepeatedKeyError(
                f"a JSON object repeats a name (its entry {position}): one of the two would be "
                "lost; merge the keyring by hand"
            )
        out[name] = value
    return out
