"""The offload tier's files on disk: one private subdirectory per engine process, swept at start.

A tier's ciphertexts are unreadable once its process is gone (the epoch secrets behind their keys
live only in that process's memory, `kvguard.offload.keys`), and a clean stop deletes them. A
process that is killed (kill -9, OOM killer, power loss) cannot: its files stay behind, undecryptable
but taking disk space, and nothing would ever delete them. Two engine processes may also be pointed
at the same directory.

The configured directory may be shared with other programs (/dev/shm, /tmp): kvguard creates it if
missing but never changes its mode and never deletes anything in it (a review: a sweep there made
/dev/shm 0700 and deleted other programs' `tier-*` directories and `*.kvb` files). Its files live in
a subdirectory of its own, `kvguard-tier/` (0700), refused (ConfigError) when it is a symbolic link,
not a directory, owned by another user, or group- or world-writable: whoever could write there could
plant names for the sweep.

In it, each tier claims a subdirectory `tier-<pid>-<12 hex>/`, beside a lock file
`tier-<pid>-<12 hex>.lock` on which it holds an exclusive `flock` for its whole life. The kernel
releases that lock when the process dies, however it dies. At start, a tier sweeps `kvguard-tier/`:
every lock file it can lock belongs to a process that is gone, and its subdirectory is deleted (then
the lock file); a live engine's lock cannot be taken, so its files are never touched. Also deleted:
subdirectories without a lock file and half-made claims nobody holds. The sweep deletes only names
of exactly the form it creates (`_NAME`); anything else there is left alone.

The claim cannot be confused with a dead one: the lock file is created under a temporary name,
locked, and only then renamed to its final name, and the subdirectory is made after that; a sweeper
that takes a temporary file before its creator locked it deletes it, and the creator then finds it
gone at the rename and tries a new name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvguard.errors import ConfigError
from kvguard.logging import get_logger

SUBDIR: Final = "kvguard-tier"
PREFIX: Final = "tier-"
_HEX: Final = 12
# Exactly the names `_claim` makes, so the sweep never deletes anything it did not create.
_NAME: Final = re.compile(rf"{PREFIX}[0-9]+-[0-9a-f]{{{_HEX}}}")
_CLAIM_TRIES: Final = 8
_log = get_logger("kvguard.offload.tierdir")


@dataclass(frozen=True, slots=True)
class Swept:
    """What a start-up sweep deleted: entries (files) and bytes left by stopped processes."""

    entries: int = 0
    bytes: int = 0

    def __add__(self, other: Swept) -> Swept:
        return Swept(self.entries + other.entries, self.bytes + other.bytes)


class TierDirectory:
    """This process's own subdirectory of the offload directory `root` (module docstring)."""

    def __init__(self, root: str | Path) -> None:
        # An operator may point the offload directory at another disk through a link: followed here,
        # deliberately; kvguard's own subdirectory in it is never a link (`own_dir`).
        self.root = own_dir(Path(root).resolve())
        self.swept = sweep(self.root)
        if self.swept.entries:
            _log.warning(
                "offload directory: deleted entries left by an engine that stopped without "
                "cleaning up (unreadable: their keys ended with it)",
                entries=self.swept.entries,
                bytes=self.swept.bytes,
            )
        self.path, self._fd = _claim(self.root)

    @property
    def lock_path(self) -> Path:
        return self.root / f"{self.path.name}.lock"

    def close(self) -> None:
        """Delete the subdirectory with whatever is left in it, then the lock file. Idempotent."""
        if self._fd < 0:
            return
        _remove_tree(self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path)
        os.close(self._fd)
        self._fd = -1


def own_dir(configured: Path) -> Path:
    """kvguard's subdirectory of the configured offload directory, created 0700 if missing. The
    configured directory is created if missing and otherwise left as it is (it may be /dev/shm).
    Raises ConfigError when the subdirectory is not one only this user can write to."""
    configured.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = configured / SUBDIR
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem is not None:
        raise ConfigError(
            f"offload directory: {path} {problem}; kvguard keeps its tier files there and deletes "
            f"what stopped engines left in it (remove it, or set offload_dir elsewhere)"
        )
    return path


def sweep(root: Path) -> Swept:
    """Delete what processes that are gone left in `root` (kvguard's own subdirectory); never a
    live process's files, never a name that `_claim` does not make."""
    total = Swept()
    for lock in sorted(root.glob(f"{PREFIX}*.lock")):
        if not _NAME.fullmatch(lock.name.removesuffix(".lock")):
            continue
        fd = _try_lock(lock)
        if fd is None:
            continue  # a live engine's, or one another sweeper is deleting right now
        try:
            total += _remove_tree(root / lock.name.removesuffix(".lock"))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
        finally:
            os.close(fd)
    for sub in sorted(root.glob(f"{PREFIX}*")):
        if _NAME.fullmatch(sub.name) and not (root / f"{sub.name}.lock").exists():
            total += _remove_tree(sub)  # its owner's lock file is gone: an interrupted sweep
    for tmp in sorted(root.glob(f".{PREFIX}*.tmp")):
        if not _NAME.fullmatch(tmp.name[1:].removesuffix(".tmp")):
            continue
        fd = _try_lock(tmp)
        if fd is not None:  # a claim whose process died before finishing it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.close(fd)
    return total


def _claim(root: Path) -> tuple[Path, int]:
    for _ in range(_CLAIM_TRIES):
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(_HEX // 2)}"
        tmp = root / f".{name}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, root / f"{name}.lock")
        except (BlockingIOError, FileNotFoundError):  # a sweeper took it first: a new name
            os.close(fd)
            continue
        path = root / name
        path.mkdir(mode=0o700)
        return path, fd
    raise OSError(f"could not claim a subdirectory of the offload directory {root}")


def _try_lock(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _remove_tree(path: Path) -> Swept:
    """Delete the subdirectory `path` and its files. A symbolic link in its place is removed, never
    followed: a link planted in the offload directory must not make the sweep delete files
    elsewhere."""
    total = Swept()
    if path.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return total
    if not path.is_dir():
        return total
    for child in path.iterdir():
        total += _remove_file(child)
    shutil.rmtree(path, ignore_errors=True)
    return total


def _remove_file(path: Path) -> Swept:
    try:
        size = path.lstat().st_size  # a link's own size: its target is not ours to count
        os.unlink(path)
    except FileNotFoundError:
        return Swept()
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
        return Swept()
    return Swept(1, size)
