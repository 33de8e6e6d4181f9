"""The encrypted offload tier: KV blocks kept in host memory (and optionally a local directory) under
their reuse domain's data key, within a byte budget (issue 15).

A block is stored under its address: the reuse domain it was computed in, the engine's block hash
(already salted per scope), the layer range and the block's position in the sequence. Only a lookup
from the same domain can find it (a different domain is a different key of the index *and* a
different data key). Every ciphertext is AES-256-GCM with associated data binding the scope tag, the
block hash, the layer range, the position and the key epoch, so a ciphertext moved to another
address, another domain or another epoch fails authentication. A failed authentication is never
served: the entry is dropped and `TierAuthError` tells the caller to recompute (and to record it).

Crypto-shredding (`shred`): the domain's data key is destroyed (see `kvguard.offload.keys`) and its
ciphertexts deleted from memory and disk. Entries left behind by an epoch that is gone are
undecryptable and are dropped on sight.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag

from kvguard.errors import TierAuthError, TierReadError
from kvguard.logging import get_logger
from kvguard.offload.keys import OffloadKeys, Shred
from kvguard.offload.tierdir import Swept, TierDirectory
from kvguard.secretfile import write_private_file

_log = get_logger("offload.tier")

AAD_LABEL: Final = b"kvguard/offload-block/v1"
OVERHEAD_BYTES: Final = 12 + 16  # nonce + GCM tag


@dataclass(frozen=True, slots=True)
class BlockAddress:
    """Where a block belongs: its reuse domain and, inside it, which KV it holds."""

    domain: bytes  # Scope.domain_key: the index key and the data key's domain
    scope_tag: str  # the public pseudonym of the domain, bound into the ciphertext
    block_hash: bytes
    layers: tuple[int, int]  # [first, last) layer range the payload covers
    position: int  # the block's index in its sequence

    def aad(self, epoch: int) -> bytes:
        tag = self.scope_tag.encode()
        return (
            AAD_LABEL
            + struct.pack(">I", len(tag))
            + tag
            + struct.pack(">I", len(self.block_hash))
            + self.block_hash
            + struct.pack(">IIQQ", self.layers[0], self.layers[1], self.position, epoch)
        )

    def key(self) -> tuple[bytes, bytes, tuple[int, int], int]:
        return (self.domain, self.block_hash, self.layers, self.position)


@dataclass
class _Entry:
    address: BlockAddress
    epoch: int
    nonce: bytes
    size: int  # ciphertext bytes
    created_at: float
    data: bytes | None = None  # in memory; None when on disk
    path: Path | None = None


@dataclass(frozen=True, slots=True)
class Removal:
    """What left the tier: entries and ciphertext bytes, for the ledger and the metrics."""

    entries: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class ShredReport:
    """One domain shredded: its key destroyed and its ciphertexts deleted."""

    key: Shred | None
    removed: Removal


class EncryptedTier:
    """An LRU store of encrypted blocks, `budget_bytes` of ciphertext at most (thread-safe)."""

    def __init__(
        self,
        keys: OffloadKeys,
        *,
        budget_bytes: int,
        directory: str | Path | None = None,
        clock: Callable[[], float],
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError("the offload tier's budget must be positive")
        self._keys = keys
        self._budget = budget_bytes
        # A subdirectory of its own in `directory`/kvguard-tier, locked while this process lives;
        # what killed engines left there is deleted first (kvguard.offload.tierdir).
        self._home = TierDirectory(directory) if directory is not None else None
        self._dir = self._home.path if self._home is not None else None
        self._clock = clock
        self._entries: OrderedDict[tuple[bytes, bytes, tuple[int, int], int], _Entry] = (
            OrderedDict()
        )
        self._used = 0
        self._lock = threading.Lock()

    @property
    def swept(self) -> Swept:
        """What the start-up sweep of the directory deleted (left by engines that were killed)."""
        return self._home.swept if self._home is not None else Swept()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, address: BlockAddress, payload: bytes | memoryview, *, to_disk: bool = False
    ) -> Removal:
        """Encrypt and store `payload` (replacing an entry at the same address); returns what the
        budget evicted to make room. A payload larger than the whole budget is not stored."""
        if to_disk and self._dir is None:
            raise ValueError("this tier has no directory")
        key = self._keys.current(address.domain)
        nonce, sealed = key.encrypt(payload, address.aad(key.epoch))
        entry = _Entry(address, key.epoch, nonce, len(sealed), self._clock())
        if to_disk:
            assert self._dir is not None
            entry.path = self._dir / f"{secrets.token_hex(16)}.kvb"
            try:
                write_private_file(entry.path, sealed)
            except BaseException:  # a full disk: no partial ciphertext outlives the failed spill
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                raise
        else:
            entry.data = sealed
        with self._lock:
            evicted = self._drop(address.key())
            if entry.size > self._budget:
                self._delete_file(entry)
                return evicted
            freed = [evicted]
            while self._used + entry.size > self._budget and self._entries:
                _, oldest = self._entries.popitem(last=False)
                freed.append(self._forget(oldest))
            self._entries[address.key()] = entry
            self._used += entry.size
        return Removal(sum(r.entries for r in freed), sum(r.bytes for r in freed))

    def get(self, address: BlockAddress) -> bytes | None:
        """The block's plaintext, authenticated; None when the tier does not hold it (or only under
        a shredded epoch). Raises TierAuthError (and drops the entry) when authentication fails,
        TierReadError (and drops it) when its file cannot be read."""
        with self._lock:
            entry = self._entries.get(address.key())
            if entry is None:
                return None
            self._entries.move_to_end(address.key())
        key = self._keys.key(address.domain, entry.epoch)
        if key is None:  # its epoch was shredded: unreadable by design
            self._forget_entry(address, entry)
            return None
        where = f"scope tag {address.scope_tag}, position {address.position}"
        try:
            sealed = entry.data if entry.data is not None else self._read(entry)
        except OSError as exc:  # an I/O error, a deleted or replaced file: recomputed
            if not self._forget_entry(address, entry):
                return None  # dropped by another thread since the lookup: gone, not unreadable
            raise TierReadError(
                f"offloaded block unreadable ({where}, {type(exc).__name__}): recompute"
            ) from None
        try:
            return key.decrypt(entry.nonce, sealed, address.aad(entry.epoch))
        except InvalidTag:
            self._forget_entry(address, entry)
            raise TierAuthError(
                f"offloaded block failed authentication ({where}): recompute"
            ) from None

    def _forget_entry(self, address: BlockAddress, entry: _Entry) -> bool:
        """Drop `entry` (if the address still holds it): what cannot be served is not kept.
        Whether it was still held."""
        with self._lock:
            return self._drop(address.key(), only=entry).entries > 0

    def discard(self, address: BlockAddress) -> Removal:
        """Delete one entry (budget or expiry decided elsewhere); nothing when it is not held."""
        with self._lock:
            return self._drop(address.key())

    def shred(self, domain: bytes) -> ShredReport:
        """Destroy `domain`'s data key, then delete its ciphertexts (memory and disk)."""
        shred = self._keys.shred(domain)
        with self._lock:
            doomed = [k for k in self._entries if k[0] == domain]
            removed = [self._drop(k) for k in doomed]
        return ShredReport(shred, Removal(len(removed), sum(r.bytes for r in removed)))

    def expire(self, older_than_s: float, domain: bytes | None = None) -> Removal:
        """Delete entries stored more than `older_than_s` seconds ago (of one domain, or all)."""
        cutoff = self._clock() - older_than_s
        with self._lock:
            doomed = [
                k
                for k, e in self._entries.items()
                if e.created_at <= cutoff and (domain is None or k[0] == domain)
            ]
            removed = [self._drop(k) for k in doomed]
        return Removal(len(removed), sum(r.bytes for r in removed))

    def domain_usage(self, domain: bytes) -> Removal:
        """Entries and bytes `domain` holds now."""
        with self._lock:
            held = [e.size for k, e in self._entries.items() if k[0] == domain]
        return Removal(len(held), sum(held))

    def close(self) -> None:
        """Shred every key and delete every ciphertext (a tier never outlives its process)."""
        self._keys.shred_all()
        with self._lock:
            for key in list(self._entries):
                self._drop(key)
            if self._home is not None:
                self._home.close()

    # --- internals (under the lock) -----------------------------------------------------------

    def _drop(
        self, key: tuple[bytes, bytes, tuple[int, int], int], *, only: _Entry | None = None
    ) -> Removal:
        entry = self._entries.get(key)
        if entry is None or (only is not None and entry is not only):
            return Removal()
        del self._entries[key]
        return self._forget(entry)

    def _forget(self, entry: _Entry) -> Removal:
        self._used -= entry.size
        entry.data = None
        self._delete_file(entry)
        return Removal(1, entry.size)

    @staticmethod
    def _delete_file(entry: _Entry) -> None:
        if entry.path is not None:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # replaced by something else: forgotten, and said so
                _log.warning("offload file not deleted", error_type=type(exc).__name__)
            entry.path = None

    @staticmethod
    def _read(entry: _Entry) -> bytes:
        """The entry's ciphertext from its file. A file that is gone raises (an `io` failure, as
        the docs say), never reads as b"": that would fail authentication and be recorded as
        tampering (a review)."""
        if entry.path is None:  # forgotten (dropped, shredded) since `get` looked it up
            raise FileNotFoundError("the entry's file was deleted with the entry")
        return entry.path.read_bytes()
