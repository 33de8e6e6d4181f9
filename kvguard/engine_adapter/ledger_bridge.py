"""Carry custody events into the audit ledger, filtered by each tenant's audit level (G5).

Custody speaks in float seconds and its own event kinds; the ledger wants `AuditEvent`s with UTC
timestamps. The bridge converts, drops what the owner's audit level does not ask for, and submits
through the ledger's non-blocking queue. When the ledger cannot take more (overflow policy
`fail_closed`), `LedgerUnavailableError` propagates so the engine refuses new work (G7) instead of
serving it unrecorded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Final, Protocol

from kvguard.audit.events import AuditEvent
from kvguard.engine_adapter.records import CustodyEvent, EventKind
from kvguard.policy import AuditLevel

# Which custody events each audit level records. Cleanup and purges are always evidence; per-request
# allocation and reuse records are the volume knob.
AUDITED: Final[dict[AuditLevel, frozenset[EventKind]]] = {
    AuditLevel.MINIMAL: frozenset(
        {
            EventKind.ZEROIZE,
            EventKind.SESSION_PURGE,
            EventKind.TENANT_PURGE,
            EventKind.MODEL_PURGE,
            EventKind.ADAPTER_PURGE,
        }
    ),
    AuditLevel.STANDARD: frozenset(
        {
            EventKind.ZEROIZE,
            EventKind.SESSION_PURGE,
            EventKind.TENANT_PURGE,
            EventKind.MODEL_PURGE,
            EventKind.ADAPTER_PURGE,
            EventKind.RELEASE,
            EventKind.EVICT,
            EventKind.REUSE,
        }
    ),
    AuditLevel.FULL: frozenset(EventKind),
}


class Submitter(Protocol):
    def submit(self, event: AuditEvent) -> None: ...


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
        count = 0
        for event in events:
            if (
                event.scope_tag is None
                or event.kind in AUDITED[self._level_for_tag(event.scope_tag)]
            ):
                self._ledger.submit(to_audit_event(event))
                count += 1
        self.submitted += count
        return count
