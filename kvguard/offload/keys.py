"""Data keys of the offload tier: one AES-256-GCM key per reuse domain and key epoch (issue 15).

KV blocks that leave the device for host memory or a local directory are encrypted under a key that
belongs to exactly one reuse domain (the scope's canonical encoding, `Scope.domain_key`) and one
*epoch* of that domain. The key is derived with HKDF-SHA256:

    key = HKDF(ikm = active salt key, salt = epoch secret,
               info = "kvguard/offload-key/v1" || len(domain) || domain || epoch)

- **Derived from the salt keyring, domain-separated from the salts.** Salts and scope tags are
  HMAC-SHA256 under their own labels (`kvguard/salt/v1`, `kvguard/scope-tag/v1`); this label and
  HKDF's extract-then-expand keep the data keys independent of both: knowing a salt or a tag tells
  nothing about a data key, and the other way round.
- **Shreddable.** The epoch secret is 32 random bytes made when the epoch starts and held only in
  this process's memory (never logged, stored or exported). Shredding a domain overwrites its epoch
  secret and starts a new epoch: the old key cannot be derived again from anything kvguard still
  holds, the keyring included, so every ciphertext of the old epoch is unreadable (crypto-shredding).
  A restart shreds everything the same way: a tier's ciphertexts never outlive the process that
  wrote them.
- **Nonces never repeat under a key.** A 96-bit GCM nonce is a 32-bit random prefix drawn once per
  key followed by a 64-bit counter that only counts up; every key is new per epoch (a fresh random
  epoch secret), and a key refuses to encrypt once its counter would wrap (2**64 blocks), so no
  (key, nonce) pair is ever used twice. The random prefix is defence in depth, not what uniqueness
  rests on.

Python cannot promise that no copy of a key survives in freed memory (OpenSSL holds its own copy
inside the cipher object): shredding drops every reference kvguard holds and overwrites the epoch
secret it owns.
"""

from __future__ import annotations

import secrets
import struct
import threading
from dataclasses import dataclass
from typing import Final

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvguard.errors import OffloadKeyError
from kvguard.isolation.keyring import Keyring

KEY_LABEL: Final = b"kvguard/offload-key/v1"
EPOCH_SECRET_BYTES: Final = 32
NONCE_COUNTER_LIMIT: Final = 1 << 64


def _info(domain: bytes, epoch: int) -> bytes:
    return KEY_LABEL + struct.pack(">I", len(domain)) + domain + struct.pack(">Q", epoch)


class DataKey:
    """One domain's key for one epoch: encrypts with fresh nonces, decrypts what it encrypted."""

    __slots__ = ("_aead", "_counter", "_lock", "_prefix", "epoch")

    def __init__(self, key: bytes, epoch: int) -> None:
        self._aead: AESGCM | None = AESGCM(key)
        self._prefix = secrets.token_bytes(4)
        self._counter = 0
        self._lock = threading.Lock()
        self.epoch = epoch

    def __repr__(self) -> str:
        return f"DataKey(epoch={self.epoch}, shredded={self._aead is None})"

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> tuple[bytes, bytes]:
        """(nonce, ciphertext with its 16-byte tag)."""
        with self._lock:
            aead = self._aead
            if aead is None:
                raise OffloadKeyError("the data key was shredded")
            if self._counter >= NONCE_COUNTER_LIMIT:
                raise OffloadKeyError("the data key's nonce counter is exhausted; shred and re-key")
            nonce = self._prefix + struct.pack(">Q", self._counter)
            self._counter += 1
        return nonce, aead.encrypt(nonce, plaintext, aad)

    def decrypt(self, nonce: bytes, ciphertext: bytes, aad: bytes) -> bytes:
        """The plaintext; raises cryptography's InvalidTag when anything was changed."""
        aead = self._aead
        if aead is None:
            raise OffloadKeyError("the data key was shredded")
        return aead.decrypt(nonce, ciphertext, aad)

    def destroy(self) -> None:
        self._aead = None


@dataclass(frozen=True, slots=True)
class Shred:
    """What one shred destroyed: the epoch whose key is gone and the one that starts."""

    destroyed_epoch: int
    new_epoch: int


class _Epoch:
    __slots__ = ("key", "number", "secret")

    def __init__(self, number: int, secret: bytearray, key: DataKey) -> None:
        self.number = number
        self.secret = secret
        self.key = key


class OffloadKeys:
    """The current data key of every reuse domain that has offloaded blocks (thread-safe)."""

    def __init__(self, keyring: Keyring) -> None:
        self._ikm = keyring.secret(keyring.active)
        self._epochs: dict[bytes, _Epoch] = {}
        self._next_epoch: dict[bytes, int] = {}  # epoch numbers only go up, also after a shred
        self._lock = threading.Lock()

    def current(self, domain: bytes) -> DataKey:
        """The key new ciphertexts of `domain` are written under (its epoch starts on first use)."""
        with self._lock:
            epoch = self._epochs.get(domain)
            if epoch is None:
                epoch = self._start(domain)
            return epoch.key

    def key(self, domain: bytes, epoch: int) -> DataKey | None:
        """The key of `domain` at `epoch`, or None when that epoch was shredded (or never was)."""
        with self._lock:
            current = self._epochs.get(domain)
            return current.key if current is not None and current.number == epoch else None

    def shred(self, domain: bytes) -> Shred | None:
        """Destroy `domain`'s key (its epoch secret is overwritten); None when it had none. The next
        `current` starts a new epoch with a new random secret."""
        with self._lock:
            epoch = self._epochs.pop(domain, None)
            if epoch is None:
                return None
            epoch.secret[:] = bytes(len(epoch.secret))
            epoch.key.destroy()
            return Shred(epoch.number, self._next_epoch[domain])

    def domains(self) -> list[bytes]:
        with self._lock:
            return list(self._epochs)

    def shred_all(self) -> int:
        """Shred every domain (key rotation, shutdown); returns how many keys were destroyed."""
        return sum(self.shred(d) is not None for d in self.domains())

    def _start(self, domain: bytes) -> _Epoch:
        number = self._next_epoch.get(domain, 0)
        self._next_epoch[domain] = number + 1
        secret = bytearray(secrets.token_bytes(EPOCH_SECRET_BYTES))
        key = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=bytes(secret), info=_info(domain, number)
        ).derive(self._ikm)
        epoch = _Epoch(number, secret, DataKey(key, number))
        self._epochs[domain] = epoch
        return epoch
