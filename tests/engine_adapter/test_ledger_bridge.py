"""Custody events reach the ledger as valid AuditEvents, filtered by audit level."""

from __future__ import annotations

import pytest

from kvguard.audit.ledger import Ledger
from kvguard.audit.request_ids import RID_DIGEST_PREFIX, ledger_request_id, recorded_forms
from kvguard.audit.signing import SigningKey
from kvguard.audit.writer import expand
from kvguard.engine_adapter.ledger_bridge import (
    AUDITED,
    LedgerBridge,
    PendingEvent,
    to_audit_event,
    to_audit_events,
)
from kvguard.engine_adapter.records import CustodyEvent, EventKind
from kvguard.policy import AuditLevel


def _ledger(tmp_path) -> Ledger:
    return Ledger.open(
        f"sqlite:///{tmp_path / 'l.db'}",
        origin="log.kvguard.test/bridge",
        signing_key=SigningKey.generate("log.kvguard.test/bridge"),
    )


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

    def submit_many(self, events, *, wait: bool = True) -> None:
        self.events.extend(expand(events))

    def refusing(self) -> bool:
        return False


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


@pytest.mark.parametrize("count", [1, 4096, 4097, 10_000])
def test_events_over_the_block_limit_are_split_and_their_figures_add_up(count: int) -> None:
    ids = tuple(range(count))
    purge = CustodyEvent(
        EventKind.TENANT_PURGE,
        1.0,
        None,
        None,
        ids,
        {"command_id": 7, "blocks_quarantined": count, "blocks_active_doomed": 3},
    )
    clear = CustodyEvent(
        EventKind.ZEROIZE,
        2.0,
        None,
        None,
        ids,
        {
            "block_count": count,
            "bytes_cleared": count * 512,
            "blocks_verified": 5,
            "verified": True,
        },
    )
    for event, counted in ((purge, "blocks_quarantined"), (clear, "block_count")):
        parts = to_audit_events(event)
        assert len(parts) == -(-count // 4096)
        assert [b for p in parts for b in p.block_ids] == list(ids)
        assert all(len(p.block_ids) <= 4096 for p in parts)
        assert sum(p.details[counted] for p in parts) == count
        assert all(p.details[counted] == len(p.block_ids) for p in parts)
        if len(parts) > 1:
            assert [p.details["part"] for p in parts] == list(range(1, len(parts) + 1))
    purge_parts, clear_parts = to_audit_events(purge), to_audit_events(clear)
    assert sum(p.details["blocks_active_doomed"] for p in purge_parts) == 3
    assert sum(p.details["bytes_cleared"] for p in clear_parts) == count * 512
    assert sum(p.details["blocks_verified"] for p in clear_parts) == 5
    assert all(p.details["command_id"] == 7 for p in purge_parts)


def test_audit_levels_do_what_docs_policy_md_says() -> None:
    """minimal: zeroizations, purges, evictions (and repairs); standard: plus allocations, reuse and
    releases, one entry per request; full: the same, one entry per block."""
    ledger = Recorder()
    levels = {
        "st_min": AuditLevel.MINIMAL,
        "st_std": AuditLevel.STANDARD,
        "st_full": AuditLevel.FULL,
    }
    bridge = LedgerBridge(ledger, lambda tag: levels[tag or ""])
    kinds = (
        EventKind.ALLOC,
        EventKind.REUSE,
        EventKind.RELEASE,
        EventKind.EVICT,
        EventKind.ZEROIZE,
    )
    for tag in levels:
        ledger.events.clear()
        bridge.forward([CustodyEvent(k, 1.0, tag, "r", (1, 2, 3), {}) for k in kinds])
        got = [(e.kind, len(e.block_ids)) for e in ledger.events]
        if tag == "st_min":
            assert got == [("block.evict", 3), ("block.zeroize", 3)]
        elif tag == "st_std":
            assert [k for k, _ in got] == [k.value for k in kinds] and {n for _, n in got} == {3}
        else:
            per_block = [k for k, n in got if n == 1]
            assert per_block.count("block.alloc") == 3 and per_block.count("block.release") == 3
            assert ("block.zeroize", 3) in got


@pytest.mark.parametrize(
    "rid",
    [
        "r" * 129,
        "",
        "an id with spaces",
        "caf\u00e9",
        "tab\there",
        "new\nline",
        "\ud800x",
        "cmpl-jane.doe@example.com-0-a1b2c3d4",
        "https://x.example/p?q=1",
        '{"user":"jane"}',
        "!~",
        # Identifier-shaped, still chosen by a person: a user name, a ticket, a phone number.
        "jane.doe",
        "cmpl-jane.doe-0-a1b2c3d4",
        "chatcmpl-jane_doe-a1b2c3d4",
        "cmpl-4155550123-0-a1b2c3d4",
        "r" * 128,
        "01ARZ3NDEKTSV4RRFFQ69G5FAV",
        "trace:4bf92f3577b34da6a3ce929d0e0e4736.00f067aa0ba902b7_1",
        "1234567890",
        "rid-sha256:" + "0" * 31,
        # The Responses API takes a body `request_id` with no prefix: digits a person typed.
        "555-0142-a1b2c3d4",
        "078051120-a1b2c3d4",
        "17-a1b2c3d4",  # the offline LLM's counter looks the same
        "cmpl-4111111111111111-0-a0a3dc02",  # 16 digits: a card number, not vLLM's random id
        "4111111111111111-a0a3dc02",
    ],
)
def test_request_ids_a_client_chose_are_recorded_as_a_digest(rid: str) -> None:
    out = ledger_request_id(rid)
    assert out is not None and out.startswith(RID_DIGEST_PREFIX) and len(out) <= 128
    assert out == ledger_request_id(rid)  # deterministic: an auditor with the id finds it
    assert ledger_request_id(rid + "x") != out
    assert ledger_request_id(out) == out  # the recorded form is kept as it is
    assert recorded_forms(rid) == sorted({rid, out})
    event = CustodyEvent(EventKind.ALLOC, 1.0, "st_a", rid, (1,), {})
    assert to_audit_event(event).request_id == out


@pytest.mark.parametrize(
    "rid",
    [
        None,
        "cmpl-9f86d081884c7d65-0-a1b2c3d4",  # vLLM's completion id: random 16 hex, prompt, suffix
        "chatcmpl-9f86d081884c7d65-a1b2c3d4",
        "chatcmpl-9f86d081884c7d65-a1b2c3d4_2",
        "chatcmpl-550e8400-e29b-41d4-a716-446655440000-9f0a1b2c",
        "cmpl-4bf92f3577b34da6a3ce929d0e0e4736-0-a1b2c3d4",  # a W3C trace id as X-Request-Id
        "tokenize-9f86d081884c7d65",
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "9f86d081884c7d65-a1b2c3d4",
    ],
)
def test_request_ids_vllm_generated_are_recorded_as_they_are(rid: str | None) -> None:
    assert ledger_request_id(rid) == rid


def test_the_bridge_queues_sources_and_counts_the_entries_they_become() -> None:
    ledger = Recorder()
    queued: list = []
    ledger.submit_many = lambda events, wait=True: queued.extend(events)  # type: ignore[method-assign]
    bridge = LedgerBridge(ledger, lambda _tag: AuditLevel.FULL)
    events = [
        CustodyEvent(EventKind.ALLOC, 1.0, "st_a", "r", (1, 2, 3), {}),  # full: one entry a block
        CustodyEvent(EventKind.ZEROIZE, 1.0, "st_a", None, tuple(range(5000)), {}),  # two parts
    ]
    assert bridge.forward(events) == 5 and bridge.submitted == 5
    assert all(isinstance(q, PendingEvent) for q in queued)  # nothing built on this thread
    assert len(expand(queued)) == 5


def test_an_event_the_schema_refuses_is_recorded_redacted_and_the_writer_goes_on(
    tmp_path, caplog
) -> None:
    ledger = _ledger(tmp_path)
    try:
        bridge = LedgerBridge(ledger, lambda _tag: AuditLevel.STANDARD)
        secret = "hunter2-prompt-text"
        bad = CustodyEvent(EventKind.RELEASE, 2.0, "st_a", "r1", (4,), {"prompt": secret})
        good = CustodyEvent(EventKind.ALLOC, 3.0, "st_a", "r2", (5,), {"handover_zeroize": 0})
        bridge.forward([bad, good])
        ledger.flush(10)
        page = ledger.query(limit=10)
        kinds = [(r.event.kind, r.event.request_id, r.event.details) for r in page.records]
    finally:
        ledger.close()
    assert kinds == [
        ("block.release", None, {"redacted": True}),
        ("block.alloc", ledger_request_id("r2"), {"handover_zeroize": 0}),
    ]
    assert secret not in caplog.text


def test_an_auditor_finds_a_digested_request_id_by_the_id_itself(tmp_path) -> None:
    ledger = _ledger(tmp_path)
    try:
        bridge = LedgerBridge(ledger, lambda _tag: AuditLevel.STANDARD)
        bridge.forward(
            [
                CustodyEvent(EventKind.ALLOC, 1.0, "st_a", "cmpl-jane.doe-0-a1b2c3d4", (5,), {}),
                CustodyEvent(
                    EventKind.ALLOC, 2.0, "st_a", "cmpl-9f86d081884c7d65-0-a1b2c3d4", (6,), {}
                ),
            ]
        )
        ledger.flush(10)
        stored = [r.event.request_id for r in ledger.query(limit=10).records]
        by_id = ledger.query(request_id="cmpl-jane.doe-0-a1b2c3d4", limit=10).records
        by_digest = ledger.query(request_id=stored[0], limit=10).records
        plain = ledger.query(request_id="cmpl-9f86d081884c7d65-0-a1b2c3d4", limit=10).records
    finally:
        ledger.close()
    assert stored == [
        ledger_request_id("cmpl-jane.doe-0-a1b2c3d4"),
        "cmpl-9f86d081884c7d65-0-a1b2c3d4",
    ]
    assert not any("jane" in (rid or "") for rid in stored)
    assert [r.event.block_ids for r in by_id] == [[5]]
    assert [r.event.block_ids for r in by_digest] == [[5]]
    assert [r.event.block_ids for r in plain] == [[6]]
