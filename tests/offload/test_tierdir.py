"""The offload tier's directory (kvguard.offload.tierdir): what a killed engine left on disk is
deleted when the next tier starts, a live engine's files never are, and a clean stop leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvguard.isolation.keyring import Keyring
from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeys
from kvguard.offload.tierdir import SUBDIR, TierDirectory, sweep

ROOT = Path(__file__).resolve().parents[2]


def addr(position: int) -> BlockAddress:
    return BlockAddress(b"domain-a", "st_a", b"h" * 32, (0, 2), position)


def open_tier(directory: Path) -> EncryptedTier:
    return EncryptedTier(
        OffloadKeys(Keyring.generate()),
        budget_bytes=1 << 20,
        directory=directory,
        clock=lambda: 0.0,
    )


_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvguard.isolation.keyring import Keyring
    from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeys
    tier = EncryptedTier(OffloadKeys(Keyring.generate()), budget_bytes=1 << 20,
                         directory=Path(sys.argv[1]), clock=lambda: 0.0)
    for i in range(3):
        tier.put(BlockAddress(b"d", "st_d", b"h" * 32, (0, 2), i), b"k" * 1000, to_disk=True)
    print("ready", flush=True)
    time.sleep(120)
    """
)


def killed_engine(directory: Path) -> None:
    """A process that stores three entries on disk and is then killed with SIGKILL."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)


def test_entries_of_a_killed_engine_are_deleted_at_the_next_start(tmp_path: Path) -> None:
    root = tmp_path / "offload"
    killed_engine(root)
    own = root / SUBDIR
    assert len(list(own.glob("tier-*/*.kvb"))) == 3  # nobody cleaned up after kill -9
    tier = open_tier(root)
    assert (tier.swept.entries, tier.swept.bytes) == (3, 3 * (1000 + 16))
    assert list(own.glob("*/*.kvb")) == []
    mine = tier._home
    assert mine is not None
    assert sorted(p.name for p in own.iterdir()) == sorted([mine.path.name, mine.lock_path.name])
    tier.close()
    assert list(own.iterdir()) == []


def test_a_live_engines_files_are_never_swept(tmp_path: Path) -> None:
    root = tmp_path / "offload"
    first = open_tier(root)
    first.put(addr(0), b"a" * 500, to_disk=True)
    second = open_tier(root)  # another engine process pointed at the same directory
    assert second.swept.entries == 0
    assert first.get(addr(0)) == b"a" * 500
    second.put(addr(0), b"b" * 500, to_disk=True)  # same address, its own subdirectory
    assert first.get(addr(0)) == b"a" * 500 and second.get(addr(0)) == b"b" * 500
    assert sweep(root / SUBDIR).entries == 0  # both locks are held
    second.close()
    assert first.get(addr(0)) == b"a" * 500
    first.close()
    assert list((root / SUBDIR).iterdir()) == []


def test_interrupted_states_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "offload"
    own = root / SUBDIR
    own.mkdir(parents=True, mode=0o700)
    orphan = own / "tier-1-00000000aaaa"  # a subdirectory whose lock an interrupted sweep removed
    orphan.mkdir()
    (orphan / "e.kvb").write_bytes(b"y" * 20)
    (orphan / "f.kvb").write_bytes(b"x" * 10)
    (own / ".tier-2-00000000bbbb.tmp").write_bytes(b"")  # a claim its process never finished
    home = TierDirectory(root)
    assert (home.swept.entries, home.swept.bytes) == (2, 30)
    assert sorted(p.name for p in own.iterdir()) == sorted([home.path.name, home.lock_path.name])
    home.close()
    home.close()  # idempotent
    assert list(own.iterdir()) == []


def test_a_claim_is_locked_before_it_is_visible(tmp_path: Path) -> None:
    """The lock file appears under its final name already locked: a sweep running at any moment
    of another process's start cannot mistake it for a dead engine's."""
    root = tmp_path / "offload"
    home = TierDirectory(root)
    fd = os.open(home.lock_path, os.O_RDWR)
    try:
        import fcntl  # noqa: PLC0415

        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    home.close()


def test_an_offload_directory_given_as_a_link_is_used_where_it_points(tmp_path: Path) -> None:
    """Operators point the offload directory at another disk through a link: the tier follows the
    operator's link (evidence directories refuse links; this one is configuration)."""
    disk = tmp_path / "fast-disk"
    disk.mkdir()
    link = tmp_path / "offload"
    link.symlink_to(disk)
    home = TierDirectory(link)
    assert home.path.parent == disk / SUBDIR
    assert home.path.is_dir()
    home.close()
    assert list((disk / SUBDIR).iterdir()) == []
