"""Public shapes of `/v1/audit`: ledger entries, inclusion and consistency proofs, checkpoints.

Hashes and leaf bytes travel as standard base64, as in export bundles (`kvguard.audit.bundle`), so
an auditor checks an API proof with the same tools as an exported one. Payloads are shown only where
they still exist; an erased payload shows as `payload: null, payload_erased: true`.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, Field

from kvguard.audit import bundle
from kvguard.audit.events import DetailValue
from kvguard.audit.query import LedgerRecord
from kvguard.audit.store import CheckpointRow


class EntryPublic(BaseModel):
    index: int
    kind: str
    ts: str = Field(description="UTC, ISO 8601 with microseconds (the leaf's own spelling)")
    scope_tag: str | None
    request_id: str | None
    block_ids: list[int]
    details: dict[str, DetailValue]
    payload: dict[str, DetailValue] | None = Field(
        description="Erasable personal detail; null when the entry has none or it was erased"
    )
    payload_erased: bool

    @classmethod
    def of(cls, record: LedgerRecord) -> EntryPublic:
        """From the leaf's JSON (its `ts` already in canonical spelling): see `LedgerRecord`."""
        leaf = json.loads(record.leaf)
        return cls(
            index=record.index,
            kind=leaf["kind"],
            ts=leaf["ts"],
            scope_tag=leaf["scope_tag"],
            request_id=leaf["request_id"],
            block_ids=leaf["block_ids"],
            details=leaf["details"],
            payload=record.payload,
            payload_erased=record.payload_erased,
        )


class EntryPage(BaseModel):
    entries: list[EntryPublic]
    next_cursor: int | None = Field(
        description="Pass as `cursor` for the next page (the last index of this one); null at the end"
    )


class EntryProof(BaseModel):
    entry: EntryPublic
    leaf: str = Field(
        description="The exact leaf bytes, base64: SHA-256(0x00 || leaf) is the leaf hash"
    )
    tree_size: int = Field(description="The tree the proof is against")
    root: str = Field(description="Root hash of that tree, base64")
    inclusion_proof: list[str] = Field(description="RFC 9162 audit path, leaf level first, base64")
    checkpoint: str | None = Field(
        description="The signed checkpoint (C2SP signed note) of `tree_size`; null when no "
        "checkpoint was signed at that size (the entry is newer than the latest checkpoint)"
    )


class CheckpointPublic(BaseModel):
    tree_size: int
    root: str = Field(description="base64")
    prev_size: int | None = Field(description="Tree size of the checkpoint before this one")
    note: str = Field(description="The C2SP signed note: verify it with the log's verifier key")

    @classmethod
    def of(cls, row: CheckpointRow) -> CheckpointPublic:
        return cls(
            tree_size=row.size, root=bundle.b64(row.root), prev_size=row.prev_size, note=row.note
        )


class CheckpointPage(BaseModel):
    checkpoints: list[CheckpointPublic]
    next_cursor: int | None = Field(
        description="Pass as `cursor` for the next page; null at the end"
    )


class ConsistencyProof(BaseModel):
    old_size: int
    new_size: int
    proof: list[str] = Field(description="RFC 9162 consistency proof, base64 (empty if equal)")


def b64_list(hashes: list[bytes]) -> list[str]:
    return [bundle.b64(h) for h in hashes]
