"""The offload tier's cryptographic core (issue 15 items 1 and 3): per-domain keys, authenticated
blocks bound to their address, lookups only within the domain, budgets, and crypto-shredding that
leaves nothing decryptable with anything kvguard still holds."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvguard.errors import TierAuthError
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.salts import SaltDeriver
from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeyError, OffloadKeys
from kvguard.offload.keys import EPOCH_SECRET_BYTES, _info


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def addr(
    domain: bytes = b"domain-a", *, position: int = 0, block_hash: bytes = b"h" * 32
) -> BlockAddress:
    return BlockAddress(domain, "st_" + domain.decode(), block_hash, (0, 32), position)


@pytest.fixture
def keyring() -> Keyring:
    return Keyring.generate()


@pytest.fixture
def tier(keyring: Keyring, tmp_path: Path) -> EncryptedTier:
    return EncryptedTier(
        OffloadKeys(keyring), budget_bytes=1 << 20, directory=tmp_path / "tier", clock=Clock()
    )


def test_roundtrip_in_memory_and_on_disk(tier: EncryptedTier) -> None:
    payload = os.urandom(4096)
    tier.put(addr(position=0), payload)
    tier.put(addr(position=1), payload, to_disk=True)
    assert tier.get(addr(position=0)) == payload
    assert tier.get(addr(position=1)) == payload
    assert tier.used_bytes == 2 * (4096 + 16)


def entry_files(root: Path) -> list[Path]:
    """The tier's ciphertext files under its directory (in its per-process subdirectory)."""
    return sorted(root.glob("kvguard-tier/*/*.kvb"))


def test_disk_files_are_private_and_hold_no_plaintext(tier: EncryptedTier, tmp_path: Path) -> None:
    payload = b"KV-PLAINTEXT-" * 300
    tier.put(addr(), payload, to_disk=True)
    (path,) = entry_files(tmp_path / "tier")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "tier").stat().st_mode) == 0o700
    assert b"KV-PLAINTEXT" not in path.read_bytes()


def test_lookups_only_within_the_domain(tier: EncryptedTier) -> None:
    tier.put(addr(b"domain-a"), b"x" * 64)
    assert tier.get(addr(b"domain-b")) is None  # same hash and position, another scope: a miss
    assert tier.get(addr(b"domain-a", position=1)) is None


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_tampered_or_moved_block_fails_and_is_dropped(
    tier: EncryptedTier, tmp_path: Path, where: str
) -> None:
    tier.put(addr(), b"y" * 256, to_disk=where == "disk")
    ((_key, entry),) = tier._entries.items()
    if where == "disk":
        assert entry.path is not None
        data = bytearray(entry.path.read_bytes())
        data[7] ^= 1
        entry.path.write_bytes(bytes(data))
    else:
        assert entry.data is not None
        entry.data = entry.data[:-1] + bytes([entry.data[-1] ^ 0x80])
    with pytest.raises(TierAuthError, match="recompute") as info:
        tier.get(addr())
    assert "yyyy" not in str(info.value)
    assert tier.get(addr()) is None and len(tier) == 0 and tier.used_bytes == 0


def test_associated_data_binds_the_address(tier: EncryptedTier) -> None:
    """A ciphertext copied to another position, hash, layer range or scope tag does not open."""
    tier.put(addr(position=3), b"z" * 128)
    ((_, entry),) = tier._entries.items()
    key = tier._keys.key(b"domain-a", entry.epoch)
    assert key is not None and entry.data is not None
    base = addr(position=3)
    assert key.decrypt(entry.nonce, entry.data, base.aad(entry.epoch)) == b"z" * 128
    for other in (
        addr(position=4),
        addr(position=3, block_hash=b"g" * 32),
        BlockAddress(base.domain, base.scope_tag, base.block_hash, (0, 16), 3),
        BlockAddress(base.domain, "st_other", base.block_hash, base.layers, 3),
    ):
        with pytest.raises(InvalidTag):
            key.decrypt(entry.nonce, entry.data, other.aad(entry.epoch))
    with pytest.raises(InvalidTag):
        key.decrypt(entry.nonce, entry.data, base.aad(entry.epoch + 1))


def test_nonces_never_repeat_under_a_key(keyring: Keyring) -> None:
    key = OffloadKeys(keyring).current(b"d")
    nonces = {key.encrypt(b"", b"")[0] for _ in range(50_000)}
    assert len(nonces) == 50_000
    key._counter = (1 << 64) - 1
    key.encrypt(b"", b"")
    with pytest.raises(OffloadKeyError, match="exhausted"):
        key.encrypt(b"", b"")


def test_each_domain_and_epoch_has_its_own_key(keyring: Keyring) -> None:
    keys = OffloadKeys(keyring)
    a, b = keys.current(b"a"), keys.current(b"b")
    nonce, sealed = a.encrypt(b"secret kv", b"aad")
    with pytest.raises(InvalidTag):
        b.decrypt(nonce, sealed, b"aad")
    keys.shred(b"a")
    again = keys.current(b"a")
    assert again.epoch == a.epoch + 1
    with pytest.raises(InvalidTag):
        again.decrypt(nonce, sealed, b"aad")


def test_keys_are_domain_separated_from_salts_and_tags(keyring: Keyring) -> None:
    """The data key is not a salt or tag of the same secret: HKDF under its own label, salted with
    the epoch secret. (A sanity check on the construction, not a proof.)"""
    keys = OffloadKeys(keyring)
    key = keys.current(b"domain")
    deriver = SaltDeriver(keyring)
    epoch = keys._epochs[b"domain"]
    raw = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=bytes(epoch.secret), info=_info(b"domain", 0)
    ).derive(keyring.secret(keyring.active))
    nonce, sealed = key.encrypt(b"kv", b"")
    assert AESGCM(raw).decrypt(nonce, sealed, b"") == b"kv"  # the documented derivation
    assert len(epoch.secret) == EPOCH_SECRET_BYTES
    assert raw.hex() not in repr(deriver.keyring) and raw.hex() not in repr(key)


def test_shredded_ciphertext_cannot_be_decrypted_with_anything_kvguard_holds(
    keyring: Keyring, tier: EncryptedTier, tmp_path: Path
) -> None:
    """After a shred, kvguard still holds the keyring, the new epoch and every other domain's key;
    none of them (nor any epoch number) opens a ciphertext of the shredded epoch."""
    payload = os.urandom(512)
    tier.put(addr(position=0), payload)
    tier.put(addr(position=1), payload, to_disk=True)
    tier.put(addr(b"domain-b"), payload)
    captured = [
        (k, e.epoch, e.nonce, e.data or (e.path.read_bytes() if e.path else b""))
        for k, e in tier._entries.items()
        if k[0] == b"domain-a"
    ]
    epoch = tier._keys._epochs[b"domain-a"]
    secret_ref = epoch.secret
    report = tier.shred(b"domain-a")
    assert report.key is not None and report.key.destroyed_epoch == 0
    assert (report.removed.entries, report.removed.bytes) == (2, 2 * (512 + 16))
    assert secret_ref == bytearray(EPOCH_SECRET_BYTES)  # overwritten in place
    assert entry_files(tmp_path / "tier") == []  # the disk copy is gone
    assert tier.get(addr(position=0)) is None and tier.get(addr(b"domain-b")) == payload
    # Everything kvguard still holds, tried against every captured ciphertext:
    held = [tier._keys.current(b"domain-a"), tier._keys.current(b"domain-b")]
    ikm = keyring.secret(keyring.active)
    current = tier._keys._epochs[b"domain-a"]  # the new epoch's secret
    salts = (b"", bytes(EPOCH_SECRET_BYTES), bytes(current.secret))
    derived = [
        AESGCM(
            HKDF(
                algorithm=hashes.SHA256(), length=32, salt=salt, info=_info(b"domain-a", n)
            ).derive(ikm)
        )
        for n in range(4)
        for salt in salts
    ]
    for key_tuple, ep, nonce, sealed in captured:
        aad = BlockAddress(
            key_tuple[0], "st_domain-a", key_tuple[1], key_tuple[2], key_tuple[3]
        ).aad(ep)
        for key in held:
            with pytest.raises(InvalidTag):
                key.decrypt(nonce, sealed, aad)
        for aead in derived:
            with pytest.raises(InvalidTag):
                aead.decrypt(nonce, sealed, aad)


def test_budget_evicts_least_recently_used(keyring: Keyring) -> None:
    tier = EncryptedTier(OffloadKeys(keyring), budget_bytes=3 * (100 + 16), clock=Clock())
    for i in range(3):
        tier.put(addr(position=i), b"p" * 100)
    assert tier.get(addr(position=0)) is not None  # now the most recently used
    removed = tier.put(addr(position=3), b"p" * 100)
    assert (removed.entries, removed.bytes) == (1, 116)
    assert tier.get(addr(position=1)) is None and tier.get(addr(position=0)) is not None
    assert tier.used_bytes == 3 * 116
    assert tier.put(addr(position=9), b"p" * 1000).entries == 0  # larger than the budget: not kept
    assert tier.get(addr(position=9)) is None and tier.used_bytes == 3 * 116


def test_expiry_and_close(keyring: Keyring, tmp_path: Path) -> None:
    clock = Clock()
    tier = EncryptedTier(
        OffloadKeys(keyring), budget_bytes=1 << 20, directory=tmp_path / "t", clock=clock
    )
    tier.put(addr(position=0), b"old", to_disk=True)
    clock.now += 100
    tier.put(addr(position=1), b"new")
    assert tier.expire(50).entries == 1
    assert tier.get(addr(position=0)) is None and tier.get(addr(position=1)) == b"new"
    tier.close()
    assert len(tier) == 0 and tier._keys.domains() == []
    assert list((tmp_path / "t" / "kvguard-tier").iterdir()) == []  # its subdirectory and lock
