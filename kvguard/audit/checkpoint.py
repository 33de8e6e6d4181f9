"""C2SP tlog-checkpoint bodies and tlog-proof@v1 files, as pure text formats.

Checkpoint body (c2sp.org/tlog-checkpoint): the origin line, the tree size in decimal (no leading
zeros), the base64 root hash, each ending in a newline, then optional extension lines. It is signed as
a signed note (`kvguard.audit.note`).

Offline proof (c2sp.org/tlog-proof@v1): `c2sp.org/tlog-proof@v1`, an optional `extra <base64>` line,
`index <N>`, one base64 audit-path hash per line, a blank line, then the signed checkpoint.

Standard library only: the offline verifier imports this module.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import NamedTuple

from kvguard.errors import VerificationError

TLOG_PROOF_HEADER = "c2sp.org/tlog-proof@v1"
_DECIMAL = re.compile(r"^(0|[1-9][0-9]{0,19})$")


class Checkpoint(NamedTuple):
    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()


def b64decode_strict(text: str, what: str) -> bytes:
    """Decode base64 and insist it is the one canonical spelling (no malleable padding bits)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise VerificationError(f"{what} is not valid base64") from None
    if base64.b64encode(raw).decode() != text:
        raise VerificationError(f"{what} is not canonical base64")
    return raw


def format_checkpoint(cp: Checkpoint) -> str:
    """The checkpoint body text (what gets signed)."""
    if not cp.origin or "\n" in cp.origin or cp.size < 0:
        raise ValueError("invalid checkpoint origin or size")
    lines = [cp.origin, str(cp.size), base64.b64encode(cp.root).decode(), *cp.extensions]
    return "".join(line + "\n" for line in lines)


def parse_checkpoint(text: str) -> Checkpoint:
    """Parse a checkpoint body; raises VerificationError if it is not exactly well-formed."""
    if not text.endswith("\n"):
        raise VerificationError("checkpoint must end with a newline")
    lines = text[:-1].split("\n")
    if len(lines) < 3 or not lines[0] or any(not line for line in lines):
        raise VerificationError("checkpoint needs an origin, a size and a root line")
    if not _DECIMAL.match(lines[1]):
        raise VerificationError("checkpoint size is not a decimal number")
    root = b64decode_strict(lines[2], "checkpoint root")
    if len(root) != 32:
        raise VerificationError("checkpoint root is not a SHA-256 hash")
    return Checkpoint(lines[0], int(lines[1]), root, tuple(lines[3:]))


def format_tlog_proof(
    index: int, proof: Sequence[bytes], signed_checkpoint: str, extra: bytes | None = None
) -> str:
    """A c2sp.org/tlog-proof@v1 file."""
    lines = [TLOG_PROOF_HEADER]
    if extra is not None:
        lines.append(f"extra {base64.b64encode(extra).decode()}")
    lines.append(f"index {index}")
    lines.extend(base64.b64encode(h).decode() for h in proof)
    return "".join(line + "\n" for line in lines) + "\n" + signed_checkpoint


class TlogProof(NamedTuple):
    leaf_index: int
    proof: list[bytes]
    signed_checkpoint: str
    extra: bytes | None


def parse_tlog_proof(text: str) -> TlogProof:
    """Parse a c2sp.org/tlog-proof@v1 file (strictly: it must re-format to the same bytes)."""
    head, sep, note = text.partition("\n\n")
    lines = head.split("\n")
    if not sep or lines[0] != TLOG_PROOF_HEADER:
        raise VerificationError("not a c2sp.org/tlog-proof@v1 file")
    rest = lines[1:]
    extra = None
    if rest and rest[0].startswith("extra "):
        extra = b64decode_strict(rest.pop(0)[6:], "tlog-proof extra")
    if not rest or not rest[0].startswith("index ") or not _DECIMAL.match(rest[0][6:]):
        raise VerificationError("tlog-proof has no valid index line")
    index = int(rest[0][6:])
    proof = [b64decode_strict(line, "tlog-proof hash") for line in rest[1:]]
    if any(len(h) != 32 for h in proof):
        raise VerificationError("tlog-proof hash is not a SHA-256 hash")
    parsed = TlogProof(index, proof, note, extra)
    if format_tlog_proof(index, proof, note, extra) != text:
        raise VerificationError("tlog-proof is not in canonical form")
    return parsed
