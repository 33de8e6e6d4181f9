"""Command links (`ledger_entry_commands`, issue 11 item 7): which entries are linked to a purge job,
that evidence found through them is the evidence the old scan of every purge entry found, that the
links are append-only, and that a ledger upgraded from revision 0002 is backfilled and still finds
it (with an app role granted before the upgrade still able to append)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from kvguard.audit import erasure
from kvguard.audit import schema as t
from kvguard.audit.certificate import REQUEST_ACTIONS
from kvguard.audit.db import create_engine, write_transaction
from kvguard.audit.erasure_query import CLOCK_SKEW_S, JobEvidence, find_evidence, find_job_evidence
from kvguard.audit.events import AuditEvent
from kvguard.audit.leaf import command_links, prepare_entry
from kvguard.audit.ledger import Ledger
from kvguard.audit.migrate import VERSION_TABLE, alembic_config
from kvguard.audit.query import select_indices
from kvguard.audit.roles import app_role_grants
from kvguard.audit.store import LedgerStore
from tests.dbs import pg_roles

from .conftest import T0

Opener = Callable[..., Ledger]
JOBS = range(1, 13)
ENGINES = ("eng-a", "eng-b", None)  # None: an engine that predates `engine_id` in its details


# --- the old lookup, kept as the reference the new one must agree with --------------------------


def _old_scan(conn: sa.Connection, stmt: sa.Select[Any]) -> Iterator[tuple[int, bytes]]:
    after = -1
    while True:
        rows = conn.execute(stmt.where(t.entries.c.idx > after).limit(500)).all()
        yield from ((int(i), bytes(leaf)) for i, leaf in rows)
        if len(rows) < 500:
            return
        after = int(rows[-1][0])


def _old_clears(
    conn: sa.Connection, purge: erasure.PurgeEntry, leaves: dict[int, bytes]
) -> dict[int, erasure.ZeroizeEntry]:
    found: dict[int, erasure.ZeroizeEntry] = {}
    if not purge.block_ids:
        return found
    links = sa.select(t.entry_blocks.c.idx).where(
        t.entry_blocks.c.block_id.in_(sorted(purge.block_ids))
    )
    stmt = select_indices(kinds=[erasure.ZEROIZE_KIND], after=purge.index).where(
        t.entries.c.idx.in_(links)
    )
    for number, (index, leaf) in enumerate(_old_scan(conn, stmt), start=1):
        z = erasure.zeroize_entry(index, erasure.parse_leaf(leaf))
        if not z.handover and erasure.same_engine(purge.engine_id, z.engine_id):
            found[index] = z
            leaves[index] = leaf
        if number % 500 == 0 and erasure.cover([purge], found.values()).complete:
            break
    return found


def old_find_job_evidence(
    ledger: Ledger, job_id: int, *, since: datetime, until: datetime
) -> JobEvidence:
    """`find_job_evidence` as it was before the command links: a scan of every purge entry since
    `since` and of every `admin.action` entry in [since, until)."""
    leaves: dict[int, bytes] = {}
    with ledger.store.engine.connect() as conn:
        purges = []
        for index, leaf in _old_scan(conn, select_indices(kinds=erasure.PURGE_KINDS, since=since)):
            obj = erasure.parse_leaf(leaf)
            if obj["details"].get("command_id") == job_id:
                purges.append(erasure.purge_entry(index, obj))
                leaves[index] = leaf
        candidates: dict[int, erasure.ZeroizeEntry] = {}
        for p in purges:
            candidates.update(_old_clears(conn, p, leaves))
        request = None
        stmt = select_indices(kinds=["admin.action"], since=since, until=until)
        for index, leaf in _old_scan(conn, stmt):
            details = erasure.parse_leaf(leaf)["details"]
            name = REQUEST_ACTIONS.get(details.get("action", ""))
            if name is not None and details.get("outcome") == "ok" and details.get(name) == job_id:
                leaves[index] = leaf
                request = index
                break
    coverage = erasure.cover(purges, candidates.values())
    used = coverage.zeroize_indices()
    kept = [p.index for p in purges] + used + ([request] if request is not None else [])
    return JobEvidence(
        purges=purges,
        zeroizes=[candidates[i] for i in used],
        coverage=coverage,
        request=request,
        leaves={i: leaves[i] for i in kept},
    )


# --- a ledger with many interleaved jobs ----------------------------------------------------------


def _created(job: int) -> datetime:
    return T0 + timedelta(minutes=2 * job)


def _window(job: int) -> tuple[datetime, datetime]:
    return _created(job) - CLOCK_SKEW_S, _created(job) + CLOCK_SKEW_S


def _request(job: int, ts: datetime, *, action: str = "purge.create", outcome: str = "ok") -> Any:
    name = REQUEST_ACTIONS.get(action, "job_id")
    details = {"action": action, "outcome": outcome, "principal": "key:abc", name: job}
    return AuditEvent(kind="admin.action", scope_tag="tt_acme", details=details, ts=ts)


def _purge(job: int, engine: str | None, blocks: list[int], ts: datetime) -> AuditEvent:
    details: dict[str, Any] = {
        "command_id": job,
        "blocks_quarantined": len(blocks),
        "blocks_active_doomed": 0,
    }
    if engine is not None:
        details["engine_id"] = engine
    return AuditEvent(
        kind=random.choice(erasure.PURGE_KINDS), block_ids=blocks, details=details, ts=ts
    )


def _zeroize(engine: str | None, blocks: list[int], ts: datetime, handover: bool) -> AuditEvent:
    details: dict[str, Any] = {
        "handover": handover,
        "verify_mode": "sample",
        "verified": True,
        "method": "torch",
        "device": "cpu",
        "block_count": len(blocks),
        "bytes_cleared": 4096 * len(blocks),
    }
    if engine is not None:
        details["engine_id"] = engine
    return AuditEvent(kind="block.zeroize", block_ids=blocks, details=details, ts=ts)


def scenario(seed: int) -> list[AuditEvent]:
    """Jobs with requests (also refused, repeated, out-of-window and `tenant.disable` ones), purge
    entries from several engines (also before the window), clears that cover, partly cover, are
    handovers or another engine's, and noise; shuffled in chunks so that jobs interleave."""
    random.seed(seed)
    chunks: list[list[AuditEvent]] = []
    for job in JOBS:
        at = _created(job)
        chunk = [_request(job, at, outcome="denied")] if job % 4 == 0 else []
        if job % 5 != 0:  # jobs of the command line have no request
            action = "tenant.disable" if job % 3 == 0 else "purge.create"
            chunk += [_request(job, at, action=action), _request(job, at)]
        if job % 6 == 0:
            chunk.append(_request(job + 1, at - timedelta(minutes=20)))  # outside job+1's window
        for engine in random.sample(ENGINES, random.randint(1, 3)):
            blocks = random.sample(range(16), random.randint(0, 5))
            late = timedelta(minutes=-7) if job % 7 == 0 else timedelta(seconds=1)
            chunk.append(_purge(job, engine, blocks, at + late))
            other = random.choice([e for e in ENGINES if e != engine])
            chunk.append(_zeroize(other, blocks, at, handover=False))
            chunk.append(_zeroize(engine, blocks[:1], at, handover=True))
            if job % 8 != 0:  # some jobs' clears never come
                chunk.append(_zeroize(engine, blocks[: len(blocks) // 2], at, handover=False))
                chunk.append(_zeroize(engine, blocks, at, handover=False))
            chunk.append(_zeroize(engine, blocks, at, handover=False))  # later: not needed
        chunk.append(AuditEvent(kind="policy.change", details={"command_id": job}, ts=at))
        chunks.append(chunk)
    events: list[AuditEvent] = []
    while chunks:  # interleave: take a few events of a random job at a time, in order
        chunk = random.choice(chunks)
        events += chunk[:2]
        del chunk[:2]
        chunks = [c for c in chunks if c]
    return events


# --- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "details", "links"),
    [
        ("tenant.purge", {"command_id": 7, "blocks_quarantined": 0}, (7,)),
        ("session.purge", {"command_id": 0}, (0,)),
        ("adapter.purge", {"command_id": True}, ()),
        ("model.purge", {"command_id": "7"}, ()),
        ("model.purge", {"command_id": 1 << 63}, ()),
        ("model.purge", {"command_id": -1}, ()),
        ("session.purge", {}, ()),
        ("admin.action", {"action": "purge.create", "outcome": "ok", "job_id": 9}, (9,)),
        ("admin.action", {"action": "tenant.disable", "outcome": "ok", "purge_job_id": 4}, (4,)),
        ("admin.action", {"action": "tenant.disable", "outcome": "ok", "job_id": 4}, ()),
        ("admin.action", {"action": "purge.create", "outcome": "denied", "job_id": 9}, ()),
        ("admin.action", {"action": "purge.certificate", "outcome": "ok", "job_id": 9}, ()),
        ("admin.action", {"action": 3, "outcome": "ok", "job_id": 9}, ()),
        ("policy.change", {"command_id": 7}, ()),
        ("block.zeroize", {"command_id": 7}, ()),
        ("key.shred", {"command_id": 7, "reason": "purge"}, (7,)),
        ("key.shred", {"reason": "expiry"}, ()),
        ("block.spill", {"command_id": 7}, ()),
    ],
)
def test_which_entries_link_to_a_job(
    kind: str, details: dict[str, Any], links: tuple[int, ...]
) -> None:
    assert command_links(kind, details) == links


def test_appends_link_purge_and_request_entries_in_the_same_transaction(
    db_url: str, open_ledger: Opener
) -> None:
    ledger = open_ledger(db_url)
    events = scenario(1)
    ledger.append_many(events[:40])
    for event in events[40:]:
        ledger.submit(event)
    ledger.flush()
    with ledger.store.engine.connect() as conn:
        stored = set(conn.execute(sa.select(t.entry_commands.c.command_id, t.entry_commands.c.idx)))
    expected = {(c, i) for i, e in enumerate(events) for c in command_links(e.kind, e.details)}
    assert stored == expected and len(expected) > 3 * len(JOBS)
    assert ledger.verify().size == len(events)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_evidence_found_through_the_links_is_what_the_scan_found(
    db_url: str, open_ledger: Opener, seed: int
) -> None:
    ledger = open_ledger(db_url)
    ledger.append_many(scenario(seed))
    windows = {job: _window(job) for job in [*JOBS, 99]}
    batch = find_evidence(ledger, windows)
    kinds = {"purge": 0, "request": 0, "complete": 0}
    for job, (since, until) in windows.items():
        old = old_find_job_evidence(ledger, job, since=since, until=until)
        assert find_job_evidence(ledger, job, since=since, until=until) == old, job
        assert batch[job] == old, job
        kinds["purge"] += bool(old.purges)
        kinds["request"] += old.request is not None
        kinds["complete"] += old.coverage.complete and bool(old.zeroizes)
    assert min(kinds.values()) >= 3  # the scenario exercises every part of the evidence


@pytest.mark.parametrize("statement", ["UPDATE {t} SET idx = idx + 1", "DELETE FROM {t}"])
def test_links_are_append_only(db_url: str, open_ledger: Opener, statement: str) -> None:
    ledger = open_ledger(db_url)
    ledger.append_many(scenario(4))
    statements = [statement]
    if ledger.store.engine.dialect.name == "postgresql":
        statements.append("TRUNCATE {t}")
    for sql in statements:
        with ledger.store.engine.connect() as conn:
            with pytest.raises(sa.exc.DBAPIError, match="forbidden"):
                conn.exec_driver_sql(sql.format(t="ledger_entry_commands"))
            conn.rollback()


def _ledger_at_0002(url: str, events: list[AuditEvent]) -> None:
    """A ledger database at revision 0002 holding `events`, appended as the code of 0002 did
    (no command links)."""
    engine = create_engine(url)
    try:
        cfg = alembic_config()
        with write_transaction(engine) as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0002_kind_index")
        LedgerStore(engine).append([prepare_entry(e)._replace(command_ids=()) for e in events])
        with write_transaction(engine) as conn:  # before 0004 the code itself moved the head
            conn.execute(sa.update(t.head).values(size=len(events)))
        assert "ledger_entry_commands" not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_upgrade_from_0002_backfills_the_links(db_url: str, open_ledger: Opener) -> None:
    many = [_request(1000 + i, T0) for i in range(2_100)]  # the backfill reads pages of 1,000
    events = scenario(5)[:30] + many + scenario(5)[30:]
    _ledger_at_0002(db_url, events)
    ledger = open_ledger(db_url)  # migrates to the newest revision
    with ledger.store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        assert (
            ctx.get_current_revision()
            == ScriptDirectory.from_config(alembic_config()).get_current_head()
        )
        diff = compare_metadata(ctx, t.metadata)
        stored = set(conn.execute(sa.select(t.entry_commands.c.command_id, t.entry_commands.c.idx)))
    assert [d for d in diff if VERSION_TABLE not in str(d)] == []
    assert stored == {
        (c, i) for i, e in enumerate(events) for c in command_links(e.kind, e.details)
    }
    for job in [*JOBS, 99]:
        since, until = _window(job)
        new = find_job_evidence(ledger, job, since=since, until=until)
        assert new == old_find_job_evidence(ledger, job, since=since, until=until), job
    ledger.append(_purge(99, "eng-a", [3], _created(99)))  # appends after the upgrade link too
    assert find_job_evidence(ledger, 99, since=_window(99)[0], until=_window(99)[1]).purges
    assert ledger.verify().size == len(events) + 1
    with ledger.store.engine.connect() as conn, pytest.raises(sa.exc.DBAPIError):
        conn.exec_driver_sql("DELETE FROM ledger_entry_commands")


def _shred(job: int | None, engine: str, ts: datetime) -> AuditEvent:
    details: dict[str, Any] = {
        "engine_id": engine,
        "reason": "purge" if job is not None else "expiry",
        "destroyed_epoch": 1,
        "entry_count": 2,
        "bytes_deleted": 8192,
    }
    if job is not None:
        details["command_id"] = job
    return AuditEvent(kind="key.shred", scope_tag="st-acme", details=details, ts=ts)


def test_upgrade_from_0004_links_the_key_shreds_stored_before_it(
    db_url: str, open_ledger: Opener
) -> None:
    """`key.shred` entries appended before 0005 (not linked then) are linked by the upgrade, so
    `verify()` agrees and a job's evidence finds them; later appends link them at once."""
    events = scenario(8)[:40]
    events += [_shred(3, "eng-a", _created(3)), _shred(None, "eng-a", _created(3))]
    events += [_shred(5, "eng-b", _created(5)) for _ in range(3)] + scenario(8)[40:60]
    engine = create_engine(db_url)
    try:
        cfg = alembic_config()
        with write_transaction(engine) as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0004_append_guards")
        LedgerStore(engine).append(
            [
                prepare_entry(e)._replace(command_ids=())
                if e.kind == "key.shred"
                else prepare_entry(e)
                for e in events
            ]
        )
    finally:
        engine.dispose()
    ledger = open_ledger(db_url)  # migrates to the newest revision
    with ledger.store.engine.connect() as conn:
        stored = set(conn.execute(sa.select(t.entry_commands.c.command_id, t.entry_commands.c.idx)))
    expected = {(c, i) for i, e in enumerate(events) for c in command_links(e.kind, e.details)}
    shreds = {(c, i) for c, i in expected if events[i].kind == "key.shred"}
    assert stored == expected and len(shreds) == 4
    assert ledger.verify().size == len(events)
    ledger.append(_shred(5, "eng-b", _created(5)))
    with ledger.store.engine.connect() as conn:
        linked = conn.execute(
            sa.select(t.entry_commands.c.idx).where(t.entry_commands.c.command_id == 5)
        ).scalars()
        assert len(events) in set(linked)


@pytest.mark.postgres
def test_an_app_role_granted_before_the_upgrade_still_appends(
    pg_url: str, open_ledger: Opener
) -> None:
    with pg_roles(pg_url) as (owner_url, app_url, app):
        events = scenario(6)
        _ledger_at_0002(owner_url, events)
        old_grants = [s for s in app_role_grants(app) if "ledger_entry_commands" not in s]
        owner = sa.create_engine(owner_url)
        with owner.begin() as conn:  # what app_role_grants gave before the new table existed
            for statement in old_grants:
                conn.exec_driver_sql(statement)
        owner.dispose()
        open_ledger(owner_url).close()  # the owner upgrades
        ledger = open_ledger(app_url)
        ledger.append(_purge(99, "eng-a", [3], _created(99)))
        evidence = find_job_evidence(ledger, 99, since=_window(99)[0], until=_window(99)[1])
        assert [p.index for p in evidence.purges] == [len(events)]
        with ledger.store.engine.connect() as conn, pytest.raises(sa.exc.DBAPIError):
            conn.exec_driver_sql("DELETE FROM ledger_entry_commands")
        ledger.close()
