"""The ledger on real SQLite and real PostgreSQL: gapless appends, proofs against signed checkpoints,
queries, erasure, rotation, schema migrations."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import timedelta

import pytest
import sqlalchemy as sa
import structlog
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from kvguard.audit import merkle, note
from kvguard.audit import schema as t
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.errors import (
    AppendOnlyViolationError,
    AuditError,
    LogRewrittenError,
    VerificationError,
)
from kvguard.logging import configure_logging

from .conftest import T0, make_event

Opener = Callable[..., Ledger]


def _cp(signed: str, key: SigningKey) -> tuple[int, bytes]:
    cp = parse_checkpoint(note.open_note(signed, [key.verifier()])[0])
    return cp.size, cp.root


def test_G5_appends_are_gapless_and_provable(
    db_url: str, open_ledger: Opener, key: SigningKey
) -> None:
    ledger = open_ledger(db_url)
    assert ledger.append(make_event(0)) == 0
    assert ledger.append_many([make_event(i) for i in range(1, 40)]) == list(range(1, 40))
    size1, root1 = _cp(ledger.checkpoint(), key)
    assert size1 == ledger.size == 40
    ledger.append_many([make_event(i) for i in range(40, 77)])
    size2, root2 = _cp(ledger.checkpoint(), key)
    assert size2 == 77
    for index in (0, 1, 38, 39):
        proof = ledger.inclusion_proof(index, size1)
        leaf = ledger.query(after=index - 1, limit=1).records[0].leaf
        merkle.verify_inclusion(index, size1, merkle.leaf_hash(leaf), proof, root1)
    merkle.verify_consistency(size1, size2, root1, root2, ledger.consistency_proof(size1, size2))
    assert ledger.root(size1) == root1
    report = ledger.verify()
    assert (report.size, report.root, report.checkpoints) == (77, root2, 2)


def test_proofs_refuse_sizes_beyond_the_log(sqlite_url: str, open_ledger: Opener) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(5)])
    with pytest.raises(ValueError):
        ledger.inclusion_proof(0, 6)
    with pytest.raises(ValueError):
        ledger.inclusion_proof(5, 5)
    assert ledger.consistency_proof(5, 5) == []


def test_query_filters_and_pagination(db_url: str, open_ledger: Opener) -> None:
    ledger = open_ledger(db_url)
    ledger.append_many([make_event(i) for i in range(60)])
    tenant1 = [i for i in range(60) if i % 3 == 1]
    page = ledger.query(scope_tag="st-tenant1", limit=7)
    seen = [r.index for r in page.records]
    while page.next_after is not None:
        page = ledger.query(scope_tag="st-tenant1", limit=7, after=page.next_after)
        seen += [r.index for r in page.records]
    assert seen == tenant1
    assert [r.index for r in ledger.query(kinds=["block.zeroize"], limit=100).records] == list(
        range(3, 60, 4)
    )
    window = ledger.query(
        since=T0 + timedelta(milliseconds=10), until=T0 + timedelta(milliseconds=13)
    )
    assert [r.index for r in window.records] == [10, 11, 12]
    assert [r.index for r in ledger.query(request_id="req-2").records] == [8, 9, 10, 11]
    by_block = [r.index for r in ledger.query(block_id=14, limit=100).records]
    assert by_block == [i for i in range(60) if 14 in (i % 97, (i * 7) % 97)]
    assert ledger.query(block_id=14).records[0].event == make_event(by_block[0])


def test_erasure_removes_the_payload_and_keeps_every_proof_valid(
    db_url: str, open_ledger: Opener, key: SigningKey
) -> None:
    ledger = open_ledger(db_url)
    ledger.append_many([make_event(i) for i in range(10)])
    personal = ledger.append(make_event(10, payload={"user": "alice@example.com", "seat": 4}))
    ledger.append_many([make_event(i) for i in range(11, 20)])
    size, root = _cp(ledger.checkpoint(), key)
    record = ledger.query(after=personal - 1, limit=1).records[0]
    assert record.event.payload == {"user": "alice@example.com", "seat": 4}
    assert b"alice" not in record.leaf

    erasure = ledger.erase_payload(personal, reason="data_subject_request")
    assert erasure == 20
    after = ledger.query(after=personal - 1, limit=1).records[0]
    assert after.leaf == record.leaf and after.payload_erased and after.event.payload is None
    with ledger.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(t.payloads)).scalar_one() == 0
    proof = ledger.inclusion_proof(personal, size)
    merkle.verify_inclusion(personal, size, merkle.leaf_hash(record.leaf), proof, root)
    size2, root2 = _cp(ledger.checkpoint(), key)
    merkle.verify_consistency(size, size2, root, root2, ledger.consistency_proof(size, size2))
    erase_event = ledger.query(kinds=["payload.erase"]).records[0].event
    assert erase_event.details["erased_index"] == personal
    assert ledger.verify().erased == 1
    with pytest.raises(AuditError):
        ledger.erase_payload(personal, reason="data_subject_request")
    assert ledger.size == 21  # the failed erasure appended nothing...
    assert ledger.append(make_event(21)) == 21  # ...and left the in-memory frontier intact
    ledger.checkpoint()
    assert ledger.verify().size == 22


def test_payload_deleted_without_erasure_record_is_detected(
    sqlite_url: str, open_ledger: Opener
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append(make_event(0, payload={"user": "bob"}))
    with ledger.store.engine.begin() as conn:  # DELETE on payloads is allowed by the schema...
        conn.execute(sa.delete(t.payloads))
    with pytest.raises(VerificationError, match="entry 0: payload deleted without"):
        ledger.verify()  # ...but not without the erasure entry


def test_key_rotation_signs_with_both_keys_during_overlap(
    sqlite_url: str, open_ledger: Opener
) -> None:
    old, new = SigningKey.generate("log.kvguard.test"), SigningKey.generate("log.kvguard.test-2")
    ledger = open_ledger(sqlite_url, signing_key=old)
    ledger.append(make_event(0))
    ledger.checkpoint()
    ledger.close()
    rotated = open_ledger(sqlite_url, signing_key=[old, new])
    rotated.append(make_event(1, kind="key.rotate", details={"key_id": new.key_id.hex()}))
    signed = rotated.checkpoint()
    assert signed.count("\n\u2014 ") == 2
    assert note.open_note(signed, [old.verifier()])[1] == [old.verifier()]
    assert note.open_note(signed, [new.verifier()])[1] == [new.verifier()]
    rotated.close()
    only_new = open_ledger(sqlite_url, signing_key=new)
    with pytest.raises(VerificationError, match="not signed by any trusted key"):
        only_new.verify()  # the first checkpoint carries only the old key...
    assert only_new.verify(extra_verifiers=[old.verifier_key()]).checkpoints == 2  # ...trusted here


def test_never_signs_a_checkpoint_inconsistent_with_the_previous(
    sqlite_url: str, open_ledger: Opener
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(8)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(8, 12)])
    with ledger.store.engine.begin() as conn:  # rewrite history under the signed checkpoint
        conn.exec_driver_sql("DROP TRIGGER ledger_hashes_no_update")
        key = t.hash_key(3, 0)
        conn.execute(sa.update(t.hashes).where(t.hashes.c.id == key).values(hash=b"\x00" * 32))
    with pytest.raises(LogRewrittenError, match="consistency proof"):
        ledger.checkpoint()
    with ledger.store.engine.connect() as conn:
        assert len(ledger.store.checkpoints(conn)) == 1
    assert issubclass(LogRewrittenError, AppendOnlyViolationError)


def test_schema_migrations_are_idempotent_and_match_the_models(
    db_url: str, open_ledger: Opener
) -> None:
    first = open_ledger(db_url)
    first.append(make_event(0))
    second = open_ledger(db_url)  # upgrading an up-to-date schema is a no-op
    assert second.size == 1
    with first.store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": "ledger_alembic_version"})
        diff = compare_metadata(ctx, t.metadata)
        assert ctx.get_current_revision() == "0005_shred_links"
    assert [d for d in diff if "ledger_alembic_version" not in str(d)] == []


def test_origin_must_be_one_line_and_a_key_is_required(sqlite_url: str) -> None:
    with pytest.raises(AuditError, match="origin"):
        Ledger.open(sqlite_url, origin="two\nlines", signing_key=SigningKey.generate("k"))
    with pytest.raises(AuditError, match="signing key"):
        Ledger.open(sqlite_url, origin="log", signing_key=[])


def test_G6_ledger_logs_carry_no_payload_or_key_material(
    sqlite_url: str, open_ledger: Opener, key: SigningKey
) -> None:
    out = io.StringIO()
    saved = structlog.get_config()
    configure_logging("DEBUG", json_output=True, stream=out)
    try:
        ledger = open_ledger(sqlite_url)
        ledger.append(make_event(0, payload={"user": "alice@example.com"}))
        ledger.checkpoint()
        ledger.erase_payload(0, reason="data_subject_request")
    finally:
        structlog.configure(**saved)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {"ledger checkpoint signed", "ledger payload erased"} <= {e["event"] for e in lines}
    assert "alice" not in out.getvalue() and key.encode() not in out.getvalue()
