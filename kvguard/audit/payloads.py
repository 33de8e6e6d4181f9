"""Erasable payloads in the log and in bundles: the commitment, the erasure reasons, `payloads.jsonl`.

A leaf never holds an event's erasable payload, only `SHA-256(prefix || salt || canonical payload)`
(`kvguard.audit.leaf`); the salt and the payload sit beside it in `ledger_payloads`, and erasing
deletes both, recorded by a `payload.erase` entry naming the erased index and a reason code.

Before issue 12 (item 7) a bundle said nothing about payloads, so a payload deleted straight from
the database (no erasure entry) looked, offline, exactly like one never written. Now every bundle
carries `payloads.jsonl`, one canonical JSON line per exported entry that has a commitment, in index
order, in one of two forms:

    {"index":N,"state":"present"}
    {"erased_by":M,"erasure_leaf":"<base64 leaf>","erasure_proof":["<base64>",...],"index":N,
     "state":"erased"}

Payloads are personal data and their salts are what keep an erased commitment from being confirmed
by guessing, so neither ever leaves in a bundle (G6): "present" is the log's signed statement
(through the manifest), made by the exporter only after it opened the commitment with the stored
payload. An erasure is always proven: the `payload.erase` entry `M` that names `N`, with its
inclusion proof against the bundle's checkpoint (so a filtered bundle proves it without holding
entries outside its filter). The verifier requires exactly one line per committed entry.
Standard library only: the offline verifier imports this module.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterator, Mapping, Sequence, Set
from enum import StrEnum
from typing import Final

from kvguard.audit import bundle, merkle
from kvguard.audit.checkpoint import Checkpoint, b64decode_strict
from kvguard.errors import VerificationError

PAYLOADS: Final = "payloads.jsonl"
COMMITMENT_PREFIX: Final = b"kvguard/audit/payload-commitment/v1\x00"
ERASE_KIND: Final = "payload.erase"
_COMMITMENT_KEY: Final = b',"payload_commitment":'


class ErasureReason(StrEnum):
    """Why a payload was erased: a code, never free text (a leaf is kept forever)."""

    DATA_SUBJECT_REQUEST = "data_subject_request"  # GDPR art. 17 / CCPA deletion request
    CONSENT_WITHDRAWN = "consent_withdrawn"
    RETENTION_EXPIRED = "retention_expired"
    LEGAL_ORDER = "legal_order"
    RECORDED_IN_ERROR = "recorded_in_error"


def commitment(salt: bytes, body: bytes) -> bytes:
    """The leaf's commitment to the canonical payload bytes `body`."""
    return hashlib.sha256(COMMITMENT_PREFIX + salt + body).digest()


def check_commitment(expected: bytes, salt: bytes, body: bytes) -> None:
    """Raise VerificationError unless (salt, body) opens `expected`."""
    if not hmac.compare_digest(commitment(salt, body), expected):
        raise VerificationError("payload does not match the commitment in its leaf")


def commitment_in_leaf(leaf: bytes) -> bytes | None:
    """The commitment a canonical leaf carries, or None. The top-level `payload_commitment` comes
    after `details` in sorted-key order, so the last occurrence of the key is the top-level one (a
    quote inside a string is escaped)."""
    at = leaf.rfind(_COMMITMENT_KEY)
    if at < 0:
        raise VerificationError("leaf has no payload_commitment field")
    value = leaf[at + len(_COMMITMENT_KEY) :]
    if value.startswith(b"null,"):
        return None
    if value[:1] != b'"' or value[65:67] != b'",':
        raise VerificationError("leaf has a malformed payload_commitment")
    try:
        return bytes.fromhex(value[1:65].decode("ascii"))
    except ValueError:
        raise VerificationError("leaf has a malformed payload_commitment") from None


def present_line(index: int) -> str:
    """The payload of entry `index` is stored (and opened its commitment at export)."""
    return _line({"index": index, "state": "present"})


def erased_line(index: int, erased_by: int, erasure_leaf: bytes, proof: Sequence[bytes]) -> str:
    return _line(
        {
            "erased_by": erased_by,
            "erasure_leaf": _b64(erasure_leaf),
            "erasure_proof": [_b64(h) for h in proof],
            "index": index,
            "state": "erased",
        }
    )


def erased_index(leaf: bytes) -> int | None:
    """The index a `payload.erase` leaf names, or None for any other leaf (or a leaf that is not
    JSON at all: a row written outside the append path proves nothing)."""
    if not bundle.is_event(leaf):  # a foreign leaf (not written by kvguard) erases nothing
        return None
    try:
        obj = json.loads(leaf)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("kind") != ERASE_KIND:
        return None
    details = obj.get("details")
    value = details.get("erased_index") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_payload_lines(
    lines: Iterator[str],
    committed: Mapping[int, bytes],
    cp: Checkpoint,
    erased_in_bundle: Set[int] = frozenset(),
) -> tuple[int, int]:
    """Check `payloads.jsonl` against the committed entries of the bundle (index -> commitment):
    one line each, in index order, each stating presence or proving the erasure; never presence
    for an entry a `payload.erase` entry of the bundle names (`erased_in_bundle`: a payload put
    back after its erasure). Returns (present, erased)."""
    wanted = iter(sorted(committed))
    present = erased = 0
    for number, line in enumerate(lines, start=1):
        where = f"{PAYLOADS} line {number}"
        index = next(wanted, None)
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise VerificationError("not a payload line (a JSON object)")
            if index is None or obj.get("index") != index:
                raise VerificationError(
                    "an extra line" if index is None else f"expected the payload of entry {index}"
                )
            if _line(obj) != line:
                raise VerificationError("line is not canonical")
            if obj.get("state") == "present":
                if index in erased_in_bundle:
                    raise VerificationError(
                        f"entry {index} is stated present, but the bundle's payload.erase entry "
                        "names it"
                    )
                present += 1
            elif obj.get("state") == "erased":
                _check_erasure(obj, index, cp)
                erased += 1
            else:
                raise VerificationError("state is neither present nor erased")
        except RecursionError:
            raise VerificationError(f"{where}: not a payload line (nested too deeply)") from None
        except (ValueError, KeyError, TypeError, AttributeError, VerificationError) as exc:
            raise VerificationError(f"{where}: {exc}") from None
    missing = next(wanted, None)
    if missing is not None:
        raise VerificationError(
            f"{PAYLOADS}: entry {missing} has a payload commitment but neither its payload nor "
            "a payload.erase entry naming it (the payload was deleted without a record)"
        )
    return present, erased


def _check_erasure(obj: Mapping[str, object], index: int, cp: Checkpoint) -> None:
    by, leaf_b64, proof = obj["erased_by"], obj["erasure_leaf"], obj["erasure_proof"]
    if not isinstance(by, int) or isinstance(by, bool) or not isinstance(proof, list):
        raise VerificationError("malformed erasure line")
    leaf = b64decode_strict(str(leaf_b64), "erasure leaf")
    if erased_index(leaf) != index:
        raise VerificationError(f"entry {by} is not a payload.erase entry naming entry {index}")
    hashes = [b64decode_strict(str(p), "erasure proof hash") for p in proof]
    merkle.verify_inclusion(by, cp.size, merkle.leaf_hash(leaf), hashes, cp.root)


def _line(obj: Mapping[str, object]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
