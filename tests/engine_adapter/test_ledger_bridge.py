"""Custody events reach the ledger as valid AuditEvents, filtered by audit level."""

from __future__ import annotations

import pytest

from kvguard.engine_adapter.ledger_bridge import AUDITED, LedgerBridge, to_audit_event
from kvguard.engine_adapter.records import CustodyEvent, EventKind
from kvguard.policy import AuditLevel


@pytest.mark.parametrize("kind", list(EventKind))
def test_every_custody_kind_is_a_ledger_kind(kind) -> None:
    event = CustodyEvent(
        kind, 1_764_000_000.5, "st_abc", "req-1", (3, 4), {"blocks_quarantined": 2}
    )
    audit = to_audit_event(event)
    assert audit.kind == kind.value and audit.block_ids == [3, 4]
    assert audit.ts.tzinfo is not None


class Recorder:
    def __init__(self) -> None:
        self.events = []

    def submit(self, event) -> None:
        self.events.append(event)


def test_audit_level_filters_per_owner() -> None:
    ledger = Recorder()
    levels = {"st_min": AuditLevel.MINIMAL, "st_full": AuditLevel.FULL}
    bridge = LedgerBridge(ledger, lambda tag: levels.get(tag or "", AuditLevel.STANDARD))
    events = [
        CustodyEvent(EventKind.ALLOC, 1.0, tag, "r", (1,), {}) for tag in ("st_min", "st_full")
    ] + [CustodyEvent(EventKind.ZEROIZE, 1.0, None, None, (1,), {"verified": True})]
    assert bridge.forward(events) == 2
    assert [e.scope_tag for e in ledger.events] == ["st_full", None]
    assert EventKind.ZEROIZE in AUDITED[AuditLevel.MINIMAL]
