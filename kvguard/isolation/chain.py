"""Salted block-hash chains for engines that have no salt support of their own.

    root  = SHA-256("kvguard/block/v1" || 0x00 || len(salt) || salt || tokens)
    child = SHA-256("kvguard/block/v1" || 0x01 || parent || tokens)
    tokens = count (4 bytes) || each id as 4 bytes, big-endian

The salt enters the root, and every later block commits to its parent, so the whole chain is scoped
(the same construction vLLM uses for `cache_salt`, made explicit). The type byte keeps a root from ever
equalling a child for some crafted salt, and the token count keeps blocks of different lengths apart.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final, NewType

from kvguard.errors import IsolationError

BlockHash = NewType("BlockHash", bytes)

_LABEL: Final = b"kvguard/block/v1"
_ROOT: Final = b"\x00"
_CHILD: Final = b"\x01"
_MAX_TOKEN: Final = (1 << 32) - 1


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f">I{len(token_ids)}I", len(token_ids), *token_ids)
    except struct.error:
        # Do not echo the ids: token ids are prompt content (G6).
        raise IsolationError(
            f"token ids must be integers in [0, {_MAX_TOKEN}] ({len(token_ids)} ids given)"
        ) from None


def chain_block_hash(parent: BlockHash | None, token_ids: Sequence[int], salt: str) -> BlockHash:
    """Hash one block of `token_ids`; `parent` is None for the first block of a sequence."""
    h = hashlib.sha256(_LABEL)
    if parent is None:
        if not salt:
            raise IsolationError("the first block of a chain needs a non-empty salt")
        raw = salt.encode("utf-8")
        h.update(_ROOT + struct.pack(">I", len(raw)) + raw)
    else:
        if len(parent) != 32:
            raise IsolationError(f"parent block hash must be 32 bytes, got {len(parent)}")
        h.update(_CHILD + parent)
    h.update(_token_bytes(token_ids))
    return BlockHash(h.digest())


def chain_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block is not cacheable)."""
    if block_size <= 0:
        raise IsolationError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_block_hash(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
