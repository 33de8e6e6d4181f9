"""A transactional outbox: ledger events committed with the state change they describe.

An admin write (a tenant, a policy version, a purge job, a key) and its ledger events commit in one
database transaction: the events go into `control_outbox`, not straight into the ledger, because the
ledger appends under its own head lock in its own transaction. `drain` then moves pending rows into
the ledger: it reads and prepares the pending rows, then, holding the ledger's head lock, appends
those still pending and stamps each with its ledger index, in the ledger's transaction. Drainers
(threads or server processes) take turns on that lock and each leaves out what the one before
delivered, so every row lands in the ledger exactly once whatever crashes or races between commit
and drain. A crash after the state commit leaves its events pending; the next drain (the API drains
after every write, at start-up and every few seconds) appends them.

The outbox keeps delivered rows (id -> ledger index) as the record of what was delivered; its rows
hold what the ledger entries hold (tenant ids only in the erasable payloads).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Final, TypeVar

import sqlalchemy as sa

from kvguard.audit.events import AuditEvent, DetailValue, EventKind
from kvguard.audit.leaf import prepare_entry
from kvguard.audit.ledger import Ledger
from kvguard.audit.store import PreparedEntry
from kvguard.control.db import ensure_schema, read_connection, write_transaction
from kvguard.control.schema import OutboxRow
from kvguard.errors import AuditError, ConfigError, LedgerUnavailableError
from kvguard.logging import get_logger

_BATCH: Final = 500
_log = get_logger("control.outbox")
T = TypeVar("T")


def admin_action_event(
    principal: str,
    role: str,
    action: str,
    outcome: str,
    *,
    ts: datetime,
    scope_tag: str | None = None,
    tenant_id: str | None = None,
    details: dict[str, DetailValue] | None = None,
) -> AuditEvent:
    """One `admin.action` entry (the admin API's and the CLI's): who, in which role, did what, with
    which outcome; the tenant only as its `tt_` tag in the leaf, its id in the erasable payload."""
    return AuditEvent(
        kind=EventKind.ADMIN_ACTION,
        scope_tag=scope_tag,
        ts=ts,
        details={
            "principal": principal[:200],
            "role": role,
            "action": action,
            "outcome": outcome,
            **(details or {}),
        },
        payload={"tenant_id": tenant_id} if tenant_id else None,
    )


def operator_principal(by: str) -> str:
    """How an operator using the `kvguard` CLI as `by` is named: in its entries and on the jobs it
    queues (a purge's certificate compares the two)."""
    return f"cli:{by}"


def operator_event(
    action: str,
    *,
    by: str = "cli",
    tenant_id: str | None = None,
    scope_tag: str | None = None,
    **details: DetailValue,
) -> AuditEvent:
    """The `admin.action` entry of a change an operator made with the `kvguard` CLI (principal
    `cli:<by>`, role `operator`). The tenant's `tt_` tag (`scope_tag`) is there only where the
    command had the salt keyring to derive it (`kvguard purge` does, for a purge's certificate);
    an entry without it is in admins' and auditors' views, not in the tenant's own export."""
    return admin_action_event(
        operator_principal(by),
        "operator",
        action,
        "ok",
        ts=datetime.now(UTC),
        scope_tag=scope_tag,
        tenant_id=tenant_id,
        details=details,
    )


def record_operator_change(
    engine: sa.Engine, change: Callable[[sa.Connection], T], event: Callable[[T], AuditEvent]
) -> T:
    """Run `change` and queue its `event` in one write transaction (the admin API, or the next
    process that drains the outbox, delivers the entry)."""
    with write_transaction(engine) as conn:
        result = change(conn)
        Outbox(engine).add(conn, [event(result)])
    return result


def event_json(event: AuditEvent) -> str:
    """An event as the outbox stores it (and `drain` reads it back)."""
    return event.model_dump_json()


class Outbox:
    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        ensure_schema(engine)

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def add(self, conn: sa.Connection, events: Sequence[AuditEvent]) -> list[int]:
        """Queue `events` inside the caller's write transaction; returns their outbox ids, in the
        order of `events` (one statement for all of them: SQLAlchemy's multi-row VALUES)."""
        if not events:
            return []
        now = time.time()
        rows = conn.execute(
            sa.insert(OutboxRow).returning(OutboxRow.id, sort_by_parameter_order=True),
            [{"created_at": now, "event": event_json(event)} for event in events],
        )
        return [int(outbox_id) for outbox_id in rows.scalars()]

    def pending(self) -> int:
        """How many committed events are not in the ledger yet."""
        with self._engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).where(OutboxRow.ledger_index.is_(None))
                ).scalar_one()
            )

    def drain(self, ledger: Ledger) -> int:
        """Append every pending event to the ledger, exactly once; returns how many this call
        appended. Raises what the ledger raises when it cannot be written (the rows stay pending).
        The ledger must live in the outbox's database: the stamp joins the ledger's transaction."""
        if ledger.store.engine.url != self._engine.url:
            raise ConfigError("the outbox drains only into a ledger in the same database")
        total = 0
        while True:
            appended, full = self._drain_batch(ledger)
            total += appended
            if not full:
                return total

    def _drain_batch(self, ledger: Ledger) -> tuple[int, bool]:
        """Up to `_BATCH` pending rows into the ledger: how many this call appended, and whether
        it read a full batch (more may be pending). The rows are read and their entries prepared
        outside the ledger's head lock (drains of several server processes do that work side by
        side); once the lock is held (`append_collected`), only those still pending are appended,
        so a row another drainer delivered meanwhile is left out, not appended in vain. Before,
        such a race rolled the whole append back to be redone, and a drain that raced five times
        in a row returned with its writers' rows still pending: the API answered writes whose
        ledger entries did not exist yet (tests/control/test_outbox_drains.py)."""
        # Autocommit: one round trip, not BEGIN, SELECT and the pool's ROLLBACK (the drain's
        # wall time is what every write's answer waits for, docs/benchmarks.md).
        with read_connection(self._engine) as conn:
            rows = conn.execute(_PENDING).all()
        if not rows:
            return 0, False
        prepared = {int(r.id): prepare_entry(AuditEvent.model_validate_json(r.event)) for r in rows}
        _first, appended = ledger.store.append_collected(_PendingClaim(prepared))
        return appended, len(rows) == _BATCH


# The pending rows of one drain batch: a statement built once (building it and its cache key cost
# about as much CPU as running it, once per drain, i.e. per write).
_PENDING: Final = (
    sa.select(OutboxRow.id, OutboxRow.event)
    .where(OutboxRow.ledger_index.is_(None))
    .order_by(OutboxRow.id)
    .limit(_BATCH)
)


class _PendingClaim:
    """The rows of one drain batch still pending once the ledger's head lock is held, and their
    stamps (`LedgerStore.append_collected`'s `Claim`: SQLAlchemy for SQLite, driver SQL that
    PostgreSQL gets in the append's two round trips). Under the head lock nothing else stamps
    these rows; fewer stamped than found pending would be a writer that bypasses the lock, and
    then nothing is appended."""

    def __init__(self, prepared: dict[int, PreparedEntry]) -> None:
        self._prepared = prepared
        self._ids: list[int] = []  # the ids still pending, in id order: the entries' order

    # SQLite (and any engine without pipelines): SQLAlchemy statements.

    def collect(self, conn: sa.Connection) -> list[PreparedEntry]:
        still = conn.execute(
            sa.select(OutboxRow.id)
            .where(OutboxRow.id.in_(list(self._prepared)), OutboxRow.ledger_index.is_(None))
            .order_by(OutboxRow.id)
        ).scalars()
        return self.take([(outbox_id,) for outbox_id in still])

    def after(self, conn: sa.Connection, first: int) -> None:
        if not self._ids:
            return
        index = {outbox_id: first + n for n, outbox_id in enumerate(self._ids)}
        done = conn.execute(
            sa.update(OutboxRow)
            .where(OutboxRow.id.in_(self._ids), OutboxRow.ledger_index.is_(None))
            .values(ledger_index=sa.case(index, value=OutboxRow.id))
        ).rowcount
        if done != len(self._ids):
            raise AuditError(
                f"{len(self._ids) - done} of {len(self._ids)} outbox rows were delivered by a "
                "writer that does not hold the ledger's head lock; nothing appended"
            )

    # PostgreSQL: the same as driver SQL, sent with the lock and with the inserts.

    def select(self) -> tuple[str, list[object]]:
        return (
            "SELECT id FROM control_outbox WHERE id = ANY(%s) AND ledger_index IS NULL ORDER BY id",
            [list(self._prepared)],
        )

    def take(self, rows: Sequence[tuple[object, ...]]) -> list[PreparedEntry]:
        self._ids = [int(row[0]) for row in rows]  # type: ignore[call-overload]
        return [self._prepared[outbox_id] for outbox_id in self._ids]

    def mark(self, first: int) -> tuple[str, list[object]]:
        # Stamped in id order from `first`; the division fails (aborting the COMMIT sent after
        # it) unless every row found pending was stamped here.
        return (
            "WITH s AS (UPDATE control_outbox o SET ledger_index = v.first + u.n - 1 "
            "FROM unnest(%s::bigint[]) WITH ORDINALITY AS u(id, n), (SELECT %s::bigint) AS v(first) "
            "WHERE o.id = u.id AND o.ledger_index IS NULL RETURNING 1) "
            "SELECT 1 / (CASE WHEN count(*) = %s THEN 1 ELSE 0 END) FROM s",
            [self._ids, first, len(self._ids)],
        )

    def refused(self) -> AuditError:
        return AuditError(
            f"some of {len(self._ids)} outbox rows were delivered by a writer that does not hold "
            "the ledger's head lock; nothing appended"
        )


class Deliverer:
    """Drains an outbox into a ledger on one thread, in group commits.

    A writer that has committed calls `deliver()`: it asks for a drain and waits for the first drain
    that *starts* after its call, which picks up every row committed before it, its own included.
    Writers arriving while a drain runs are served together by the next one: one ledger transaction
    for many writes, and no two threads of a process racing for the same rows. The thread also
    drains every `interval_s` seconds (what a crash or an outage left behind). A drain that fails
    (the ledger cannot be written) leaves the rows pending for the next one; `deliver` then returns
    False and the caller answers anyway: its change and its entries are committed."""

    def __init__(
        self, drain: Callable[[], object], *, interval_s: float | None, name: str = "kvguard-outbox"
    ) -> None:
        self._drain = drain
        self._interval = interval_s
        self._cond = threading.Condition()
        self._requested = 0
        self._done = 0
        self._ok = True
        self._stop = False
        # Writers awaiting a drain on an event loop (`deliver_async`): (target, loop, future).
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[bool]]] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def deliver(self, timeout: float = 10.0) -> bool:
        """Wait (at most `timeout` seconds) for a drain that started after this call."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._requested += 1
            target = self._requested
            self._cond.notify_all()
            while self._done < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop:
                    return False
                self._cond.wait(remaining)
            return self._ok

    async def deliver_async(self, timeout: float = 10.0) -> bool:
        """`deliver`, awaited on the event loop: no thread blocks while the drain runs (an API
        write waited for it on one of the request threads, which reads then queued for)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        with self._cond:
            if self._stop:
                return False
            self._requested += 1
            self._waiters.append((self._requested, loop, future))
            self._cond.notify_all()
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return False

    def _settle(self, done: int, ok: bool) -> None:
        """Answer the event-loop waiters whose drain has run (called with `_cond` held)."""
        ready = [w for w in self._waiters if w[0] <= done]
        self._waiters = [w for w in self._waiters if w[0] > done]
        for _target, loop, future in ready:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_resolve, future, ok)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._requested == self._done and not self._stop:
                    self._cond.wait(self._interval)
                if self._stop:
                    return
                target = self._requested
            try:
                self._drain()
                ok = True
            except Exception as exc:  # the ledger is down: rows stay pending, the next pass retries
                if isinstance(exc, AuditError) and not isinstance(exc, LedgerUnavailableError):
                    # Not an outage: the ledger refused (kvguard's own message names no secret).
                    _log.error("ledger delivery refused", error=str(exc))
                else:
                    _log.warning("ledger delivery deferred", error_type=type(exc).__name__)
                ok = False
            with self._cond:
                self._done = max(self._done, target)
                self._ok = ok
                self._cond.notify_all()
                self._settle(self._done, ok)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current drain."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            self._settle(self._requested, False)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _resolve(future: asyncio.Future[bool], ok: bool) -> None:
    if not future.done():  # not timed out meanwhile
        future.set_result(ok)
