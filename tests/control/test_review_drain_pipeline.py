"""Independent review of the two-pipeline outbox drain on PostgreSQL (641e825): exactly-once with
several processes draining at once, drains whose connection is killed between or inside the
pipelines, the frontier query at many tree sizes, the COPY path, batches, the pooled connection after
a refused mark or a lock timeout, the in-memory frontier after failures, and the app role.

Fault found and fixed: a lock timeout in the drain escaped as a bare
`psycopg.errors.LockNotAvailable` instead of SQLAlchemy's `OperationalError`, so
`ActionLog.try_deliver` (Services.open/close) and `policy_seed.seed_from_file` raised instead of
deferring, and the API's error mapping answered 500 instead of 503 (the last two tests failed on
641e825). Everything else here held."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from kvguard.audit import store
from kvguard.audit.leaf import prepare_entry
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.audit.store import LedgerStore
from kvguard.control import outbox
from kvguard.control.outbox import AuditEvent, Outbox, operator_event
from kvguard.control.schema import OutboxRow
from kvguard.errors import AuditError
from tests.dbs import fresh_pg_database, migrate_and_grant, pg_roles

from .test_outbox_drains import ORIGIN, Process, _queue, processes, stamped_without_the_lock

pytestmark = pytest.mark.postgres


@pytest.fixture
def url() -> Iterator[str]:
    with fresh_pg_database("kvg_review") as u:
        yield u


def _admin(url: str) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT")


def _check_exactly_once(p: Process) -> int:
    """Every outbox row stamped once, at the index whose leaf is its event; nothing else appended
    but what `others` says; the log verifies. Returns the ledger size."""
    with p.engine.connect() as conn:
        rows = conn.execute(sa.select(OutboxRow.id, OutboxRow.event, OutboxRow.ledger_index)).all()
        leaves = dict(conn.execute(sa.text("SELECT idx, leaf FROM ledger_entries")).all())
    pending = [r.id for r in rows if r.ledger_index is None]
    assert pending == []
    indices = [int(r.ledger_index) for r in rows]
    assert len(set(indices)) == len(indices), "an index stamped twice"
    for r in rows:
        want = prepare_entry(AuditEvent.model_validate_json(r.event)).leaf
        assert bytes(leaves[int(r.ledger_index)]) == want, f"row {r.id} stamped at a wrong leaf"
    size = p.ledger.size
    assert sorted(leaves) == list(range(size))
    assert p.ledger.verify().size == size
    return size


def _frontier_ok(p: Process) -> None:
    s = p.ledger.store
    with s.engine.connect() as conn:
        loaded = s._load_frontier(conn, s._frontier.size)
    assert loaded.size == s._frontier.size
    assert (loaded._levels, loaded._hashes) == (s._frontier._levels, s._frontier._hashes)


def test_many_processes_and_threads_drain_exactly_once(url: str) -> None:
    key = SigningKey.generate(ORIGIN)
    failures: list[BaseException] = []
    with processes(url, key, 4) as procs:
        direct = procs[3]

        def writer(p: Process, seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(12):
                    n = rng.choice([1, 1, 2, 5, 63, 64, 65, 70, 130])
                    _queue(p, n)
                    p.outbox.drain(p.ledger)
            except BaseException as exc:
                failures.append(exc)

        def appender() -> None:  # another process moves the head by plain appends meanwhile
            try:
                for i in range(15):
                    direct.ledger.append_many([operator_event("direct", i=i)] * (1 + 37 * (i % 3)))
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=writer, args=(procs[t % 3], t)) for t in range(9)] + [
            threading.Thread(target=appender)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not any(t.is_alive() for t in threads)
        assert not failures, failures
        for p in procs[:3]:
            p.outbox.drain(p.ledger)
        _check_exactly_once(procs[0])
        for p in procs[:3]:
            _frontier_ok(p)


def test_more_than_a_batch_pending_drains_in_batches(url: str) -> None:
    key = SigningKey.generate(ORIGIN)
    with processes(url, key, 3) as procs:
        _queue(procs[0], 1234)
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda p=p: results.append(p.outbox.drain(p.ledger)))
            for p in procs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert sum(results) == 1234
        assert _check_exactly_once(procs[0]) == 1234


def _terminate(admin: sa.Engine, url: str, where: str) -> int:
    db = sa.engine.make_url(url).database
    with admin.connect() as conn:
        return len(
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE datname = '{db}' AND pid <> pg_backend_pid() AND {where}"
            ).all()
        )


def _drain_until_done(p: Process, tries: int = 5) -> list[str]:
    errors = []
    for _ in range(tries):
        try:
            p.outbox.drain(p.ledger)
            if p.outbox.pending() == 0:
                return errors
        except Exception as exc:
            errors.append(type(exc).__name__)
    raise AssertionError(f"still pending after {tries} drains: {errors}")


def test_connection_killed_between_the_pipelines(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    key = SigningKey.generate(ORIGIN)
    admin = _admin(url)
    with processes(url, key, 2) as (p, q):
        _queue(p, 3)
        p.outbox.drain(p.ledger)
        take = outbox._PendingClaim.take
        killed: list[int] = []

        def kill_then_take(self: Any, rows: Any) -> Any:
            killed.append(_terminate(admin, url, "state = 'idle in transaction'"))
            return take(self, rows)

        for n in (1, 70):  # the pipelined inserts and the COPY path
            _queue(p, n)
            monkeypatch.setattr(outbox._PendingClaim, "take", kill_then_take)
            with pytest.raises(Exception):
                p.outbox.drain(p.ledger)
            monkeypatch.undo()
            assert killed[-1] == 1
            _drain_until_done(p)
        _queue(q, 2)
        q.outbox.drain(q.ledger)
        _queue(p, 2)
        _drain_until_done(p)
        _check_exactly_once(p)
        _frontier_ok(p)
    admin.dispose()


@contextmanager
def _row_locked(url: str, row_id: int) -> Iterator[None]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SELECT 1 FROM control_outbox WHERE id = {row_id} FOR UPDATE")
        try:
            yield
        finally:
            conn.rollback()
    engine.dispose()


def _wait_for(admin: sa.Engine, url: str, like: str, timeout: float = 10.0) -> None:
    db = sa.engine.make_url(url).database
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with admin.connect() as conn:
            found = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                "AND wait_event_type = 'Lock' AND query LIKE %s",
                (db, like),
            ).scalar_one()
        if found:
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing waits on {like!r}")


@pytest.mark.parametrize("entries", [2, 80])
def test_connection_killed_while_the_mark_waits(url: str, entries: int) -> None:
    """The second pipeline (inserts sent, mark blocked on a row lock) loses its connection."""
    key = SigningKey.generate(ORIGIN)
    admin = _admin(url)
    with processes(url, key, 2) as (p, q):
        _queue(p, 5)
        p.outbox.drain(p.ledger)
        ids = _queue(p, entries)
        errors: list[BaseException] = []

        def drain() -> None:
            try:
                p.outbox.drain(p.ledger)
            except BaseException as exc:
                errors.append(exc)

        with _row_locked(url, ids[-1]):
            t = threading.Thread(target=drain)
            t.start()
            _wait_for(admin, url, "WITH s AS (UPDATE control_outbox%")
            assert _terminate(admin, url, "query LIKE 'WITH s AS (UPDATE control_outbox%%'") == 1
            t.join(30)
        assert len(errors) == 1
        assert p.ledger.size == 5
        _queue(q, 3)
        q.outbox.drain(q.ledger)  # another process moves the head
        _drain_until_done(p)
        assert _check_exactly_once(p) == 5 + entries + 3
        _frontier_ok(p)
    admin.dispose()


def test_killed_after_the_commit_went_through(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """COMMIT ran in the pipeline, then the connection dies before the context exits."""
    key = SigningKey.generate(ORIGIN)
    admin = _admin(url)
    real = store.write_transaction

    @contextmanager
    def dying(engine: sa.Engine) -> Iterator[sa.Connection]:
        with real(engine) as conn:
            yield conn
            pid = conn.connection.driver_connection.info.backend_pid
            assert _terminate(admin, url, f"state = 'idle' AND pid = {pid}") == 1

    with processes(url, key, 1) as (p,):
        _queue(p, 4)
        p.outbox.drain(p.ledger)
        _queue(p, 3)
        monkeypatch.setattr(store, "write_transaction", dying)
        outcome: Any
        try:
            outcome = p.outbox.drain(p.ledger)
        except Exception as exc:
            outcome = exc
        monkeypatch.undo()
        assert p.outbox.pending() == 0, outcome
        _queue(p, 2)
        errors = _drain_until_done(p)
        assert _check_exactly_once(p) == 9, (outcome, errors)
        _frontier_ok(p)
    admin.dispose()


def _state(engine: sa.Engine) -> list[tuple[Any, Any]]:
    """The driver state of every connection the pool hands out (checked out at once)."""
    conns = [engine.connect() for _ in range(engine.pool.checkedin())]
    try:
        out = []
        for c in conns:
            raw = c.connection.driver_connection
            out.append(
                (
                    raw.info.transaction_status.name,
                    psycopg.pq.PipelineStatus(raw.pgconn.pipeline_status).name,
                )
            )
            c.exec_driver_sql("SELECT 1")
        return out
    finally:
        for c in conns:
            c.close()


@pytest.mark.parametrize("before", [0, 4, 5])
def test_refused_marks_and_lock_timeouts_leave_the_pool_usable(
    url: str, monkeypatch: pytest.MonkeyPatch, before: int
) -> None:
    """psycopg prepares a statement on its fifth run (`prepare_threshold`): refusals and lock
    timeouts after any number of earlier drains, then drains again on the same pooled connection."""
    key = SigningKey.generate(ORIGIN)
    opts = "?options=-c%20lock_timeout%3D300"
    with processes(url + opts, key, 1) as (p,):
        for _ in range(before):
            _queue(p, 2)
            p.outbox.drain(p.ledger)
        for round_ in range(3):
            # a refused mark
            ids = _queue(p, 2)
            with stamped_without_the_lock(monkeypatch, p, ids[0], -1), pytest.raises(AuditError):
                p.outbox.drain(p.ledger)
            assert all(s == ("IDLE", "OFF") for s in _state(p.ledger.store.engine))
            # a lock timeout on the head, in the first pipeline
            with p.ledger.store.engine.connect() as holder:
                holder.exec_driver_sql("SELECT size FROM ledger_head WHERE id = 1 FOR UPDATE")
                with pytest.raises(Exception) as info:
                    p.outbox.drain(p.ledger)
                holder.rollback()
            assert "lock" in str(info.value).lower(), info.value
            assert all(s == ("IDLE", "OFF") for s in _state(p.ledger.store.engine))
            # a lock timeout on a row, in the second pipeline
            with _row_locked(url, ids[1]), pytest.raises(Exception) as info:
                p.outbox.drain(p.ledger)
            assert "lock" in str(info.value).lower(), info.value
            assert all(s == ("IDLE", "OFF") for s in _state(p.ledger.store.engine))
            assert p.outbox.drain(p.ledger) == 1, round_
            _queue(p, 3)
            assert p.outbox.drain(p.ledger) == 3
        with p.engine.begin() as conn:  # the sneaked stamps are not the drain's
            conn.exec_driver_sql(
                "UPDATE control_outbox SET ledger_index = NULL WHERE ledger_index = -1"
            )
        assert p.outbox.drain(p.ledger) == 3
        _check_exactly_once(p)
        _frontier_ok(p)


def _sizes() -> list[int]:
    out = set(range(1, 140))
    for k in range(8, 17):
        out |= {(1 << k) - 1, 1 << k, (1 << k) + 1}
    out |= {3 * (1 << 15) - 1, 3 * (1 << 15), 3 * (1 << 15) + 1}
    return sorted(out)


def test_frontier_query_at_many_sizes(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process appends up to size s - 1 (plain appends, the COPY path for large steps);
    this one drains one entry at size s - 1: the frontier comes from the lock's query."""
    key = SigningKey.generate(ORIGIN)
    loads: list[int] = []
    load = LedgerStore._load_frontier

    def counted(self: LedgerStore, conn: sa.Connection, size: int) -> Any:
        loads.append(size)
        return load(self, conn, size)

    with processes(url, key, 2) as (p, q):
        ev = operator_event("bulk")
        for s in _sizes():
            gap = s - 1 - q.ledger.size
            while gap > 0:
                step = min(gap, 20_000)
                q.ledger.store.append([prepare_entry(ev)] * step)
                gap -= step
            if gap < 0:
                continue
            monkeypatch.setattr(LedgerStore, "_load_frontier", counted)
            _queue(p, 1)
            assert p.outbox.drain(p.ledger) == 1
            monkeypatch.undo()
            assert p.ledger.size == s
            _frontier_ok(p)
        assert loads == []
        assert p.ledger.verify().size == q.ledger.size


def test_app_role_runs_the_pipelines(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the app role (the grants `kvguard db grants` prints): the frontier query (another
    process appended), the COPY path, a refused mark, batches."""
    key = SigningKey.generate(ORIGIN)
    with fresh_pg_database("kvg_review_roles") as u, pg_roles(u) as (owner_url, app_url, app):
        migrate_and_grant(owner_url, app)
        with processes(app_url, key, 2) as (p, q):
            for n in (1, 2, 70, 3, 600, 1):
                _queue(q, n)
                q.outbox.drain(q.ledger)
                _queue(p, n)
                p.outbox.drain(p.ledger)
            ids = _queue(p, 2)
            with stamped_without_the_lock(monkeypatch, p, ids[0], 99999), pytest.raises(AuditError):
                p.outbox.drain(p.ledger)
            assert p.outbox.drain(p.ledger) == 1
            assert p.ledger.verify().size == 2 * (1 + 2 + 70 + 3 + 600 + 1) + 1
            _frontier_ok(p)
            _frontier_ok(q)


@pytest.mark.parametrize("start", [120, 250, 32_760, 65_530, 2**31 - 5])
def test_outbox_ids_across_integer_widths(url: str, start: int) -> None:
    """The claim's `id = ANY(%s)` gets a psycopg list dump whose element type follows the values."""
    key = SigningKey.generate(ORIGIN)
    with processes(url, key, 1) as (p,):
        _queue(p, 2)
        with p.engine.begin() as conn:
            conn.exec_driver_sql(f"SELECT setval('control_outbox_id_seq', {start})")
        try:
            ids = _queue(p, 12)
        except sa.exc.DBAPIError as exc:
            pytest.skip(f"the id column does not hold {start}: {exc.orig}")
        assert max(ids) > start
        assert p.outbox.drain(p.ledger) == 14
        _check_exactly_once(p)


# -- Fault: the pipelines run on the raw psycopg connection, so a lock timeout or a lost connection
# during a PostgreSQL drain escapes as a bare `psycopg.Error`, not the `sqlalchemy.exc.DBAPIError`
# the callers catch (before 641e825 every drain statement went through SQLAlchemy, which wraps it).
# `ActionLog.try_deliver` (Services.open / close, and the API before its delivery thread runs) and
# `policy_seed` catch `SQLAlchemyError`, and the API answers 503 only for SQLAlchemy's DBAPIError.


def _failing_drain(
    p: Process, how: str, monkeypatch: pytest.MonkeyPatch, admin: sa.Engine, url: str
) -> Any:
    """Run `how` against a drain of one queued row; return what the drain raised."""
    from kvguard.api.actions import ActionLog  # noqa: PLC0415

    actions = ActionLog(p.ledger, None, time.time, outbox=p.outbox)  # type: ignore[arg-type]
    _queue(p, 1)
    if how == "lock timeout":
        with p.ledger.store.engine.connect() as holder:
            holder.exec_driver_sql("SELECT size FROM ledger_head WHERE id = 1 FOR UPDATE")
            try:
                return actions.try_deliver()
            except Exception as exc:
                return exc
            finally:
                holder.rollback()
    take = outbox._PendingClaim.take

    def kill_then_take(self: Any, rows: Any) -> Any:
        _terminate(admin, url, "state = 'idle in transaction'")
        return take(self, rows)

    monkeypatch.setattr(outbox._PendingClaim, "take", kill_then_take)
    try:
        return actions.try_deliver()
    except Exception as exc:
        return exc
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("how", ["lock timeout", "connection lost"])
def test_a_drain_that_cannot_write_the_ledger_is_a_deferred_delivery(
    url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    from kvguard.api.errors import status_for  # noqa: PLC0415

    key = SigningKey.generate(ORIGIN)
    admin = _admin(url)
    with processes(url + "?options=-c%20lock_timeout%3D300", key, 1) as (p,):
        _queue(p, 2)
        p.outbox.drain(p.ledger)
        outcome = _failing_drain(p, how, monkeypatch, admin, url)
        if isinstance(outcome, BaseException):
            # try_deliver must not raise; and what it raised must be a 503 in the API
            # (status_for(LockNotAvailable(...)) is 500 at 641e825)
            if status_for(outcome) != 503:
                raise outcome
            raise AssertionError(repr(outcome))
        assert outcome is False, repr(outcome)  # try_deliver: "False (logged)", not an exception
        assert p.outbox.drain(p.ledger) == 1
    admin.dispose()


def test_seeding_while_the_ledger_head_is_held_leaves_the_entry_in_the_outbox(
    url: str, tmp_path: Any
) -> None:
    """`seed_from_file` (an engine's start) catches SQLAlchemyError around its drain: a held head
    must leave the seeded version's entry pending, not fail the start."""
    from kvguard.control.policy_seed import seed_from_file  # noqa: PLC0415
    from kvguard.policy.store import PolicyStore  # noqa: PLC0415

    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\ntenants:\n  restricted-co:\n    classification: restricted\n")
    slow = url + "?options=-c%20lock_timeout%3D300"
    store_, ledger = (
        PolicyStore.open(slow),
        Ledger.open(slow, origin=ORIGIN, signing_key=SigningKey.generate(ORIGIN)),
    )
    try:
        with ledger.store.engine.connect() as holder:
            holder.exec_driver_sql("SELECT size FROM ledger_head WHERE id = 1 FOR UPDATE")
            try:
                assert seed_from_file(store_, ledger, path) == 1
            finally:
                holder.rollback()
        assert Outbox(store_.engine).drain(ledger) == 1
    finally:
        ledger.close()
        store_.engine.dispose()
