"""Fixes from a review of the offload tier's files (kvguard.offload.tierdir, kvguard.offload.tier).

Each test failed before its fix:

- an `offload_dir` shared with other programs (/dev/shm, /tmp) was made 0700 (its sticky bit gone)
  and their `tier-*` directories and `*.kvb` files deleted by the start-up sweep;
- a tier file deleted behind the tier's back was reported as tampering (`auth`), not as a file
  that cannot be read (`io`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvguard.errors import ConfigError, TierReadError
from kvguard.isolation.keyring import Keyring
from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeys, tierdir
from kvguard.offload.tierdir import SUBDIR, TierDirectory


def test_a_shared_offload_dir_keeps_its_mode_and_other_programs_files(tmp_path: Path) -> None:
    shared = tmp_path / "shm"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # /dev/shm, /tmp
    (shared / "tier-backup").mkdir()
    (shared / "tier-backup" / "data").write_text("precious")
    (shared / "report.kvb").write_text("x")
    home = TierDirectory(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777  # was: 0700
    assert (shared / "tier-backup" / "data").read_text() == "precious"  # was: deleted
    assert (shared / "report.kvb").exists()  # was: deleted
    assert home.path.parent == shared / SUBDIR
    assert stat.S_IMODE((shared / SUBDIR).stat().st_mode) == 0o700
    home.close()
    assert sorted(p.name for p in shared.iterdir()) == sorted([SUBDIR, "report.kvb", "tier-backup"])


def test_the_sweep_deletes_only_names_kvguard_creates(tmp_path: Path) -> None:
    own = tmp_path / "offload" / SUBDIR
    own.mkdir(parents=True, mode=0o700)
    dead = own / "tier-123-0123456789ab"  # a killed engine's, its lock file gone
    dead.mkdir()
    (dead / "e.kvb").write_bytes(b"y" * 20)
    for name in ("tier-backup", "tier-1-aaaa", "tier-123-0123456789AB"):  # not kvguard's names
        (own / name).mkdir()
        (own / name / "keep").write_text("not the tier's")
    (own / "notes.kvb").write_text("not the tier's")
    home = TierDirectory(tmp_path / "offload")
    assert (home.swept.entries, home.swept.bytes) == (1, 20)
    assert not dead.exists()
    assert sorted(p.name for p in own.iterdir()) == sorted(
        [
            home.path.name,
            home.lock_path.name,
            "notes.kvb",
            "tier-1-aaaa",
            "tier-123-0123456789AB",
            "tier-backup",
        ]
    )
    home.close()


def test_a_symlinked_kvguard_subdirectory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "offload"
    root.mkdir()
    (root / SUBDIR).symlink_to(elsewhere)  # planted by someone sharing the directory
    with pytest.raises(ConfigError, match="symbolic link"):
        TierDirectory(root)
    assert list(elsewhere.iterdir()) == []


def test_a_group_writable_kvguard_subdirectory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "offload"
    (root / SUBDIR).mkdir(parents=True)
    os.chmod(root / SUBDIR, 0o770)
    with pytest.raises(ConfigError, match="writable"):
        TierDirectory(root)
    assert stat.S_IMODE((root / SUBDIR).stat().st_mode) == 0o770  # refused, never changed


def test_a_kvguard_subdirectory_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "offload"
    (root / SUBDIR).mkdir(parents=True, mode=0o700)
    uid = os.geteuid()
    monkeypatch.setattr(tierdir.os, "geteuid", lambda: uid + 1)  # as seen by another user
    with pytest.raises(ConfigError, match="owned by"):
        TierDirectory(root)


def test_a_deleted_tier_file_is_an_io_failure_not_tampering(tmp_path: Path) -> None:
    tier = EncryptedTier(
        OffloadKeys(Keyring.generate()), budget_bytes=1 << 20, directory=tmp_path, clock=lambda: 0.0
    )
    address = BlockAddress(b"d", "st_d", b"h" * 32, (0, 2), 0)
    tier.put(address, b"x" * 64, to_disk=True)
    (path,) = tmp_path.glob(f"{SUBDIR}/*/*.kvb")
    path.unlink()
    with pytest.raises(TierReadError):  # was: TierAuthError (recorded as reason `auth`)
        tier.get(address)
    assert len(tier) == 0 and tier.get(address) is None  # dropped, recomputed
    tier.close()
