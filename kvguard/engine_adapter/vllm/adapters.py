"""LoRA adapters in the scope: an adapter's name plus a digest of its files.

vLLM keys prefix-cache blocks of a LoRA request by the adapter's name and path, not by its weights, so
an adapter reloaded under the same name with new weights could be served KV computed with the old
ones (the class of bug behind vLLM issues 42125 and 30931). kvguard puts a revision derived from the
adapter's files into the scope: new weights, new scope, new salt, no reuse (G1).

The digest is SHA-256 over the sorted relative file names, sizes and contents under the adapter
directory. It is recomputed only when a file's size or modification time changes, so a request costs
one `stat` per file.

The digest describes the files, not the weights vLLM runs: vLLM keeps an adapter it loaded until its
LoRA cache evicts it (`--max-cpu-loras`), so right after the files change, requests under the new
digest still run the old weights, and blocks they cache would later be hit by the new ones (found
by an independent review: 256 stale tokens reused after the reload). So once an adapter's files
differ from what this server first saw, each of its requests gets a scope of its own (a random
revision, `changed:<hex>`): served, never reusing or leaving blocks anyone reuses, until the server
restarts. New weights meant to be cached are loaded under a new adapter name.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from kvguard.isolation.scope import AdapterRef

_CHUNK = 1 << 20


def _listing(root: Path) -> tuple[tuple[str, int, int], ...]:
    if root.is_file():
        st = root.stat()
        return ((root.name, st.st_size, st.st_mtime_ns),)
    out: list[tuple[str, int, int]] = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            st = path.stat()
            out.append((path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


def adapter_digest(root: Path) -> str:
    """`sha256:<hex>` over the adapter's files (names, sizes and bytes); ValueError if none exist."""
    listing = _listing(root)
    if not listing:
        raise ValueError(f"LoRA adapter at {root} has no files")
    h = hashlib.sha256(b"kvguard/adapter/v1\x00")
    for rel, size, _mtime in listing:
        h.update(rel.encode() + b"\x00" + str(size).encode() + b"\x00")
        path = root / rel if root.is_dir() else root
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


class AdapterDigests:
    """Adapter name -> `AdapterRef`, digests cached until a file changes."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[tuple[str, int, int], ...], str]] = {}
        self._first: dict[str, str] = {}  # path -> the digest this server first served it with
        self._changed: set[str] = set()  # paths whose files changed since: never reused again

    def ref(self, name: str, path: str) -> AdapterRef:
        root = Path(path)
        try:
            listing = _listing(root)
        except OSError:
            raise ValueError(f"LoRA adapter {name!r} cannot be read") from None
        cached = self._cache.get(path)
        if cached is None or cached[0] != listing:
            try:
                cached = (listing, adapter_digest(root))
            except (OSError, ValueError):  # gone, empty or unreadable: named, its path never shown
                raise ValueError(f"LoRA adapter {name!r} cannot be read") from None
            self._cache[path] = cached
        if self._first.setdefault(path, cached[1]) != cached[1]:
            self._changed.add(path)  # even if the files go back: vLLM may run either version
        if path in self._changed:  # which weights vLLM runs is unknown: no reuse either way
            return AdapterRef(id=name, revision="changed:" + secrets.token_hex(16))
        return AdapterRef(id=name, revision=cached[1])
