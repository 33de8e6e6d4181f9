"""Reading and writing secret files safely.

A secret file must be a regular file readable by its owner only: a group- or world-readable secret
is refused (ConfigError naming the path and its mode, never its content). New secret files are
created with mode 0600 atomically (no window in which another user could open them). Evidence files
(export bundles, erasure certificates, saved checkpoints) are written the same way, 0600 from their
first byte (`open_private`, `write_private_file`), in 0700 directories (`private_dir`).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import TextIO

from kvguard.errors import SecretFileError
from kvguard.logging import register_secret

_FORBIDDEN_BITS = stat.S_IRWXG | stat.S_IRWXO


def check_permissions(path: Path) -> None:
    """Raise SecretFileError unless `path` is a regular file with no group/other permission bits."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SecretFileError(f"secret file {path} does not exist") from None
    except PermissionError:
        raise SecretFileError(f"secret file {path} cannot be read by this process") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretFileError(f"secret file {path} is not a regular file")
    if st.st_mode & _FORBIDDEN_BITS:
        raise SecretFileError(
            f"secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be readable by "
            f"group or others (run: chmod 600 {path})"
        )


def read_secret_file(path: str | Path) -> bytes:
    """Return the bytes of a secret file after checking its permissions; registers it for redaction."""
    p = Path(path)
    check_permissions(p)
    data = p.read_bytes()
    if not data.strip():
        raise SecretFileError(f"secret file {p} is empty")
    register_secret(data.strip())
    return data


def write_secret_file(path: str | Path, data: bytes, *, overwrite: bool = False) -> Path:
    """Create `path` with mode 0600 and write `data`. Refuses to replace an existing file by default.

    With `overwrite` the file is replaced atomically (`_replace`): a rotation that fails half-way
    (disk full, a crash) leaves the old file whole, never an empty or truncated one whose keys are
    lost for good."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if overwrite:
        if p.is_symlink():
            # The rename would replace the link, leaving the file it points to (the one engines
            # read) as it was: a rotation reported done that rotated nothing (found by a review).
            raise SecretFileError(
                f"secret file {p} is a symbolic link; give the file it points to instead"
            )
        _replace(p, data)
    else:
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise SecretFileError(
                f"secret file {p} already exists; refusing to overwrite it"
            ) from None
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            p.unlink(missing_ok=True)  # a partial new secret is no secret file at all
            raise
        finally:
            os.close(fd)
    register_secret(data.strip())
    return p


def _replace(path: Path, data: bytes) -> None:
    """Write `data` to a 0600 temporary file beside `path`, fsync it, rename it over `path` and
    fsync the directory, so that `path` holds the old bytes or the new ones, also after a crash."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o600)  # mkstemp's mode already; said here since it is the point
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (POSIX: the entry lives in the directory's data)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform without directory fds: the rename stands, its durability is the OS's
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the data itself is synced
    finally:
        os.close(fd)


def _private_fd(path: str | Path) -> int:
    """A 0600 file opened for writing; a symbolic link at `path` is refused, not written through
    (it would overwrite, and make 0600, whatever it points at)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(Path(path), flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SecretFileError(f"{path} is a symbolic link; give the file itself") from None
        raise
    os.fchmod(fd, 0o600)  # also when it existed with another mode
    return fd


def open_private(path: str | Path, *, encoding: str = "utf-8", newline: str = "") -> TextIO:
    """Open `path` for writing text as a file only its owner can read (0600), so from the first
    byte (no window with the umask's mode). For evidence: export bundles, certificates, saved
    checkpoints. Replaces an existing file."""
    fd = _private_fd(path)
    try:
        return os.fdopen(fd, "w", encoding=encoding, newline=newline)
    except BaseException:
        os.close(fd)
        raise


def write_private_file(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` (0600, see `open_private`); text is UTF-8, newlines unchanged."""
    with os.fdopen(_private_fd(path), "wb") as f:  # writes all of it (os.write may not)
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def private_dir(path: str | Path) -> Path:
    """Create `path` (and parents) and restrict it to its owner (0700). A symbolic link there is
    refused, not followed: the mode change would land on whatever it points at (a directory of
    someone else's choosing in a shared location), and so would the evidence written into it."""
    p = Path(path)
    if p.is_symlink():
        raise SecretFileError(f"{p} is a symbolic link; give the directory itself")
    p.mkdir(parents=True, exist_ok=True)
    if p.is_symlink() or not p.is_dir():  # replaced between the check and the mkdir
        raise SecretFileError(f"{p} is not a directory")
    p.chmod(0o700)
    return p
