"""Carry custody events into the audit ledger, filtered by each tenant's audit level (G5).

Custody speaks in float seconds and its own event kinds; the ledger wants `AuditEvent`s with UTC
timestamps. The bridge drops what the owner's audit level does not ask for (on the caller's thread,
against the policy in force) and submits the rest through the ledger's non-blocking queue as
`EventSource`s: the conversion and the schema's checks (G6) run on the ledger's writer thread, so an
engine's scheduler step pays for a filter and a deque append. When the ledger cannot take more
(overflow policy `fail_closed`), `LedgerUnavailableError` propagates: the scheduler keeps the events
to submit again and starts no new request meanwhile (G7) instead of serving it unrecorded
(`SchedulerGuard._forward`).

Request ids come from clients, and a ledger entry is never erased: only ids of the shape vLLM
generates are recorded as they are, anything else (`jane.doe`, an e-mail address, a URL) as a
digest, never stopping the engine (`kvguard.audit.request_ids`). An event the schema refuses anyway
(a bug: custody's vocabulary is fixed) is recorded without its request id and details, marked
`redacted`, and logged by kind and error class only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Final, Protocol

from kvguard.audit.events import MAX_BLOCK_IDS, AuditEvent
from kvguard.audit.request_ids import ledger_request_id
from kvguard.audit.writer import Entry
from kvguard.engine_adapter.records import CustodyEvent, EventKind
from kvguard.errors import AuditError, LedgerUnavailableError
from kvguard.logging import get_logger
from kvguard.policy import AuditLevel

_log = get_logger("kvguard.engine_adapter.ledger")

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
    def submit_many(self, events: Sequence[Entry], *, wait: bool = True) -> None: ...

    def refusing(self) -> bool: ...


def to_audit_event(event: CustodyEvent) -> AuditEvent:
    """The ledger form of one custody event (tags, ids and counts only)."""
    return AuditEvent.model_validate(
        {
            "kind": event.kind.value,
            "scope_tag": event.scope_tag,
            "request_id": ledger_request_id(event.request_id),
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
    "retained",
    "freed_unzeroized",
    "handover_zeroize",
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


class PendingEvent:
    """A custody event queued for the ledger: converted and checked on the writer thread."""

    __slots__ = ("event", "parts", "per_entry")

    def __init__(self, event: CustodyEvent, per_entry: int) -> None:
        self.event = event
        self.per_entry = per_entry
        n = len(event.block_ids)
        self.parts = 1 if n <= per_entry else -(-n // per_entry)  # the entries it becomes

    def audit_events(self) -> list[AuditEvent]:
        event = self.event
        try:
            return to_audit_events(event, self.per_entry)
        except (ValueError, AuditError) as exc:  # pydantic's ValidationError is a ValueError
            _log.error(
                "custody event refused by the ledger schema; recorded redacted",
                kind=event.kind.value,
                error=type(exc).__name__,
            )
        redacted = replace(event, request_id=None, details={"redacted": True})
        try:
            return to_audit_events(redacted, self.per_entry)
        except (ValueError, AuditError):  # the tag or the ids themselves: keep the kind and time
            bare = replace(redacted, scope_tag=None, block_ids=())
            return [to_audit_event(bare)]


class LedgerBridge:
    """Filters custody events by the owner's audit level and submits them to a ledger."""

    def __init__(
        self, ledger: Submitter, level_for_tag: Callable[[str | None], AuditLevel]
    ) -> None:
        self._ledger = ledger
        self._level_for_tag = level_for_tag
        self.submitted = 0

    def forward(self, events: Iterable[CustodyEvent]) -> int:
        """Submit the events the owners' audit levels ask for (`select`). Returns the number of
        ledger entries they become."""
        return self.submit(self.select(events))

    def select(self, events: Iterable[CustodyEvent]) -> list[PendingEvent]:
        """The events the owners' audit levels, in force now, ask for; events without a scope
        (purges, zeroizations of several owners) are always recorded. Decided once, when the
        events happen: a batch the ledger refused is submitted again as selected then, not
        filtered anew under a later policy version (found by a review: an allocation made under
        `standard` during an outage was dropped when a version lowered the level before the
        ledger came back)."""
        pending: list[PendingEvent] = []
        levels: dict[str, AuditLevel] = {}  # each tag's level, looked up once a call
        for event in events:
            tag = event.scope_tag
            if tag:
                level = levels.get(tag) or levels.setdefault(tag, self._level_for_tag(tag))
                if event.kind not in AUDITED[level]:
                    continue
            else:
                level = AuditLevel.FULL
            per_entry = (
                1 if level is AuditLevel.FULL and event.kind in PER_REQUEST else MAX_BLOCK_IDS
            )
            pending.append(PendingEvent(event, per_entry))
        return pending

    def submit(self, pending: Sequence[PendingEvent]) -> int:
        """Submit selected events, all or nothing: a full queue refuses the whole batch
        (`LedgerUnavailableError`, G7), under `block` too: this runs on vLLM's scheduler thread,
        which must never wait for the database (waiting froze every tenant's running requests
        for the whole outage, found by a review). Returns the number of ledger entries."""
        self._ledger.submit_many(pending, wait=False)
        entries = sum(p.parts for p in pending)
        self.submitted += entries
        return entries

    def probe(self) -> None:
        """Raise `LedgerUnavailableError` if the ledger would refuse an entry now; records and
        queues nothing (asked before new work starts, G7)."""
        if self._ledger.refusing():
            raise LedgerUnavailableError("the audit ledger refuses entries now")
