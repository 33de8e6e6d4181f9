"""Carry custody events into the audit ledger, filtered by each tenant's audit level (G5).

Custody speaks in float seconds and its own event kinds; the ledger wants `AuditEvent`s with UTC
timestamps. The bridge converts, drops what the owner's audit level does not ask for, and submits
through the ledger's non-blocking queue. When the ledger cannot take more (overflow policy
`fail_closed`), `LedgerUnavailableError` propagates so the engine refuses new work (G7) instead of
serving it unrecorded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Final, Protocol

from kvguard.audit.events import MAX_BLOCK_IDS, AuditEvent
from kvguard.engine_adapter.records import CustodyEvent, EventKind
from kvguard.policy import AuditLevel

# Which custody events each audit level records (docs/policy.md, "Audit levels"). Cleanup, purges,
# evictions and repairs are always evidence; per-request allocation, reuse and release records are the
# volume knob, and `full` records them one entry per block.
_MINIMAL: Final = frozenset(
    {
        EventKind.CUSTODY_REPAIR,
        EventKind.QUOTA_DEFER,
        EventKind.ZEROIZE,
        EventKind.EVICT,
        EventKind.SESSION_PURGE,
        EventKind.TENANT_PURGE,
        EventKind.MODEL_PURGE,
        EventKind.ADAPTER_PURGE,
        EventKind.KEY_SHRED,
        EventKind.TIER_AUTH_FAILURE,
    }
)
PER_REQUEST: Final = frozenset(
    {EventKind.ALLOC, EventKind.REUSE, EventKind.RELEASE, EventKind.SPILL, EventKind.RESTORE}
)
AUDITED: Final[dict[AuditLevel, frozenset[EventKind]]] = {
    AuditLevel.MINIMAL: _MINIMAL,
    AuditLevel.STANDARD: _MINIMAL | PER_REQUEST,
    AuditLevel.FULL: frozenset(EventKind),
}


class Submitter(Protocol):
    def submit_many(self, events: Sequence[AuditEvent]) -> None: ...


def to_audit_event(event: CustodyEvent) -> AuditEvent:
    """The ledger form of one custody event (tags, ids and counts only)."""
    return AuditEvent.model_validate(
        {
            "kind": event.kind.value,
            "scope_tag": event.scope_tag,
            "request_id": event.request_id,
            "block_ids": list(event.block_ids),
            "details": dict(event.details),
            "ts": datetime.fromtimestamp(event.ts, UTC),
        }
    )


# Counts that describe the blocks of one entry: a split entry carries its own part of them.
_PER_BLOCK_COUNTS: Final = ("blocks_quarantined", "block_count")
# Figures that belong to the event as a whole: kept on the first part, zero on the others, so that
# summing the parts gives the event's figure.
_ONCE: Final = (
    "blocks_active_doomed",
    "blocks_verified",
    "tier_key_count",
    "tier_entry_count",
    "tier_bytes",
)


def to_audit_events(event: CustodyEvent, per_entry: int = MAX_BLOCK_IDS) -> list[AuditEvent]:
    """The ledger form of one custody event: one entry, or several of at most `MAX_BLOCK_IDS` block
    ids each when the event names more blocks than one entry may carry (a large purge or release).

    Parts carry `part` / `parts`; per-block counts and `bytes_cleared` are split in proportion, so a
    verifier summing the parts gets the event's figures back."""
    ids = event.block_ids
    if len(ids) <= per_entry:
        return [to_audit_event(event)]
    chunks = [ids[i : i + per_entry] for i in range(0, len(ids), per_entry)]
    parts = []
    for n, chunk in enumerate(chunks):
        details = {**event.details, "part": n + 1, "parts": len(chunks)}
        for key in _PER_BLOCK_COUNTS:
            if key in details:
                details[key] = len(chunk)
        for key in _ONCE:
            if key in details and n > 0:
                details[key] = 0
        total = event.details.get("bytes_cleared")
        if isinstance(total, int) and not isinstance(total, bool):
            details["bytes_cleared"] = total // len(ids) * len(chunk)
        parts.append(to_audit_event(replace(event, block_ids=chunk, details=details)))
    return parts


class LedgerBridge:
    """Filters custody events by the owner's audit level and submits them to a ledger."""

    def __init__(
        self, ledger: Submitter, level_for_tag: Callable[[str | None], AuditLevel]
    ) -> None:
        self._ledger = ledger
        self._level_for_tag = level_for_tag
        self.submitted = 0

    def forward(self, events: Iterable[CustodyEvent]) -> int:
        """Submit the events the owners' audit levels ask for; events without a scope (purges,
        zeroizations of several owners) are always recorded."""
        entries: list[AuditEvent] = []
        for event in events:
            level = self._level_for_tag(event.scope_tag) if event.scope_tag else AuditLevel.FULL
            if event.scope_tag is not None and event.kind not in AUDITED[level]:
                continue
            per_entry = (
                1 if level is AuditLevel.FULL and event.kind in PER_REQUEST else MAX_BLOCK_IDS
            )
            entries.extend(to_audit_events(event, per_entry))
        # All or nothing: under `fail_closed` a full queue refuses the whole batch (G7).
        self._ledger.submit_many(entries)
        self.submitted += len(entries)
        return len(entries)
