"""Commands for engines, through the database: purges and policy changes (CLI and admin API).

The API and engine processes share nothing but the database (ARCHITECTURE.md, data flow). A command is
a row in `engine_commands`, numbered `seq` in commit order: the number is taken from the
`command_head` row under its row lock, held until the submitting transaction commits, so no command
can commit after a higher-numbered one was read. Every engine attached to the database executes every
command numbered after the newest one when it started (a fresh engine holds no older state, so older purges have nothing to act on, and it loads
the current policy version itself) and records an acknowledgement row per engine in
`engine_command_acks` with what it did, in counts only. Kinds: `purge` (selector kind and value) and
`policy` (`selector_value` is the policy store version to load). An engine reads "numbered after the
last one I read" and acknowledges each command once, so it runs every command exactly once whatever
the order in which submitters commit (an `id` cursor skipped commands on PostgreSQL, where ids are
drawn before commit). A submit may join the caller's transaction (`conn=`), so a command commits
with the state change that caused it, or not at all.

Delivery. An engine's link thread (`EngineLink` in the vLLM adapter) reads new commands every half
second (`LINK_FETCH_S`) and queues them; the scheduler thread runs them at its next request or
step, without a database round trip of its own. On PostgreSQL every submit also runs
`NOTIFY kvguard_commands` in its transaction (delivered at commit, never for a rolled-back
command), and the engine runs a `CommandListener`: a daemon thread that `LISTEN`s on a dedicated
connection, raises a flag and runs the link's tick at once, which reads the announced command
instead of waiting out the half second. The listener never touches engine state, reconnects
with back-off when the connection drops (raising the flag after each reconnect, since notifications
sent meanwhile are lost), and stops within half a second of `close()`; being a daemon thread, it never
holds up interpreter exit. SQLite has no notifications: engines on SQLite keep polling.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import sqlalchemy as sa

from kvguard.control.db import (
    ensure_schema,
    open_engine,
    reading,
    write_transaction,
)
from kvguard.control.schema import HEAD_ID, CommandHead, EngineCommand, EngineCommandAck
from kvguard.errors import ConfigError
from kvguard.isolation.scope import Scope
from kvguard.logging import get_logger

NOTIFY_CHANNEL: Final = "kvguard_commands"
_LISTEN_POLL_S: Final = 0.5  # longest wait for a notification before checking close()
_HURRY_POLL_S: Final = 0.05  # the wait while `hurry` is in force (work handed over is expected)
_RECONNECT_S: Final = (0.5, 1.0, 2.0, 5.0)
_log = get_logger("engine.commands")


class PurgeKind(StrEnum):
    SESSION = "session"
    TENANT = "tenant"
    MODEL = "model"
    ADAPTER = "adapter"


@dataclass(frozen=True, slots=True)
class PurgeSelector:
    """Which owners a purge removes. `value` is the session, tenant, model or adapter id."""

    kind: PurgeKind
    value: str
    tenant_id: str | None = None  # a session purge is always within one tenant

    def matches(self, scope: Scope) -> bool:
        if self.kind is PurgeKind.TENANT:
            return scope.tenant_id == self.value
        if self.kind is PurgeKind.SESSION:
            return scope.session_id == self.value and (
                self.tenant_id is None or scope.tenant_id == self.tenant_id
            )
        if self.kind is PurgeKind.MODEL:
            return scope.model.id == self.value
        return scope.adapter is not None and scope.adapter.id == self.value


@dataclass(frozen=True, slots=True)
class PurgeCommand:
    id: int  # the purge job id the API reports and the ledger's purge entries carry
    selector: PurgeSelector
    seq: int = 0


@dataclass(frozen=True, slots=True)
class PolicyCommand:
    """Load this version from the policy store (engines never go back to an older version)."""

    id: int
    version: int
    seq: int = 0


@dataclass(frozen=True, slots=True)
class SkippedCommand:
    """A command row this version cannot read (an unknown kind, or a selector it cannot parse:
    written by a newer control plane during a rolling upgrade). Engines step past it without
    running or acknowledging it, so a purge job never counts an engine that did not purge."""

    id: int
    kind: str
    seq: int = 0


Command = PurgeCommand | PolicyCommand


# The acknowledgements of a page of jobs, built once (statement building costs about as much as
# running it on the API's read path).
_ACKS_FOR = (
    sa.select(
        EngineCommandAck.command_id,
        EngineCommandAck.engine_id,
        EngineCommandAck.done_at,
        EngineCommandAck.result,
    )
    .where(EngineCommandAck.command_id.in_(sa.bindparam("ids", expanding=True)))
    .order_by(EngineCommandAck.command_id, EngineCommandAck.engine_id)
)


class CommandQueue:
    """Submit commands (admin API, CLI) and read them in commit order (engines)."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        ensure_schema(engine)

    @classmethod
    def open(cls, url: str) -> CommandQueue:
        return cls(open_engine(url))

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def submit_purge(
        self,
        selector: PurgeSelector,
        *,
        requested_by: str,
        conn: sa.Connection | None = None,
        created_at: float | None = None,
    ) -> int:
        """Queue a purge; returns its job id. With `conn`, inside the caller's write transaction.
        `created_at`: the instant the caller counted the engines the job waits for (the job report
        waits for the engines live at `created_at`; default: now)."""
        if not selector.value:
            raise ConfigError("a purge needs a non-empty session, tenant, model or adapter id")
        if selector.kind is PurgeKind.SESSION and not selector.tenant_id:
            raise ConfigError("a session purge needs the tenant the session belongs to")
        return self._submit(
            conn,
            kind="purge",
            selector_kind=selector.kind.value,
            selector_value=selector.value,
            tenant_id=selector.tenant_id,
            requested_by=requested_by,
            created_at=created_at,
        )

    def submit_policy(
        self, version: int, *, requested_by: str, conn: sa.Connection | None = None
    ) -> int:
        """Tell every engine to load policy store version `version`."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ConfigError("a policy command needs a stored policy version (1 or more)")
        return self._submit(
            conn,
            kind="policy",
            selector_kind="version",
            selector_value=str(version),
            tenant_id=None,
            requested_by=requested_by,
        )

    def _submit(
        self, conn: sa.Connection | None, *, created_at: float | None = None, **values: Any
    ) -> int:
        if conn is None:
            with write_transaction(self._engine) as own:
                return self._submit(own, created_at=created_at, **values)
        # The head row stays locked until the caller commits: numbers are handed out in commit
        # order, so an engine that has read number n has seen every command numbered below it.
        # One `UPDATE ... RETURNING` takes the row lock and the number in one round trip (a
        # `SELECT ... FOR UPDATE` and an `UPDATE` before): the lock is held for a round trip less.
        seq = int(
            conn.execute(
                sa.update(CommandHead)
                .where(CommandHead.id == HEAD_ID)
                .values(seq=CommandHead.seq + 1)
                .returning(CommandHead.seq)
            ).scalar_one()
        )
        new_id = conn.execute(
            sa.insert(EngineCommand)
            .values(created_at=time.time() if created_at is None else created_at, seq=seq, **values)
            .returning(EngineCommand.id)
        ).scalar_one()
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text(f"NOTIFY {NOTIFY_CHANNEL}"))  # sent at commit
        return int(new_id)

    def latest_seq(self) -> int:
        """The number of the newest committed command (0: none yet)."""
        with self._engine.connect() as conn:
            value = conn.execute(sa.select(sa.func.max(EngineCommand.seq))).scalar_one()
            return int(value or 0)

    def pending_after(self, last_seq: int, *, limit: int = 1000) -> list[Command | SkippedCommand]:
        """Commands numbered after `last_seq`, in commit order; a row this version cannot read is a
        `SkippedCommand`, so a reader's cursor still moves past it."""
        t = EngineCommand
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.id, t.seq, t.kind, t.selector_kind, t.selector_value, t.tenant_id)
                .where(t.seq > last_seq)
                .order_by(t.seq)
                .limit(limit)
            ).all()
        out: list[Command | SkippedCommand] = []
        for r in rows:
            try:
                if r.kind == "purge":
                    kind = PurgeKind(r.selector_kind)
                    selector = PurgeSelector(kind, r.selector_value, r.tenant_id)
                    out.append(PurgeCommand(r.id, selector, r.seq))
                    continue
                if r.kind == "policy":
                    out.append(PolicyCommand(r.id, int(r.selector_value), r.seq))
                    continue
            except (ValueError, TypeError):
                pass
            out.append(SkippedCommand(r.id, str(r.kind), r.seq))
        return out

    def acknowledge(self, command_id: int, engine_id: str, result: dict[str, Any]) -> None:
        """Record that `engine_id` ran `command_id` (once: a second acknowledgement is ignored)."""
        with write_transaction(self._engine) as conn:
            done = conn.execute(
                sa.select(EngineCommandAck.command_id).where(
                    EngineCommandAck.command_id == command_id,
                    EngineCommandAck.engine_id == engine_id,
                )
            ).first()
            if done is not None:
                return
            conn.execute(
                sa.insert(EngineCommandAck).values(
                    command_id=command_id,
                    engine_id=engine_id,
                    done_at=time.time(),
                    result=json.dumps(result, sort_keys=True),
                )
            )

    def acks(self, command_id: int) -> list[dict[str, Any]]:
        return self.acks_for([command_id]).get(command_id, [])

    def acks_for(
        self, command_ids: Sequence[int], conn: sa.Connection | None = None
    ) -> dict[int, list[dict[str, Any]]]:
        """The acknowledgements of several commands in one query (on `conn`, a read connection
        the caller holds for several reads, or on one of its own)."""
        out: dict[int, list[dict[str, Any]]] = {}
        if not command_ids:
            return out
        with reading(self._engine, conn) as c:
            rows = c.execute(_ACKS_FOR, {"ids": list(command_ids)}).all()
        for r in rows:
            out.setdefault(int(r.command_id), []).append(
                {"engine_id": r.engine_id, "done_at": r.done_at, **json.loads(r.result)}
            )
        return out


class CommandListener:
    """Wakes an engine's command poll on PostgreSQL `NOTIFY kvguard_commands` (module docstring).

    `tick`, if given, runs on the same thread after every wait of at most half a second (the engine
    link's chores: keep-alive, idle wake-up checks); on SQLite, which has no notifications, the
    thread only ticks. Without `tick` a SQLite listener would have nothing to do and is refused."""

    def __init__(self, engine: sa.Engine, *, tick: Callable[[], None] | None = None) -> None:
        self._listens = engine.dialect.name == "postgresql"
        if not self._listens and tick is None:
            raise ConfigError("command notifications need PostgreSQL; SQLite engines poll")
        self._engine = engine
        self._tick = tick
        self._woken = threading.Event()
        self._hurry_until = float("-inf")
        self._listening = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvguard-command-listener", daemon=True
        )

    @classmethod
    def open(cls, url: str) -> CommandListener:
        return cls(open_engine(url))

    def start(self) -> CommandListener:
        self._thread.start()
        return self

    def take(self) -> bool:
        """True if a command was announced since the last call (clears the flag)."""
        if not self._woken.is_set():
            return False
        self._woken.clear()
        return True

    def wait(self, timeout: float) -> bool:
        """Block until a notification arrives (tests); True if one did."""
        return self._woken.wait(timeout)

    def wait_listening(self, timeout: float) -> bool:
        """Block until the LISTEN is in place (tests); True if it is."""
        return self._listening.wait(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def hurry(self, seconds: float) -> None:
        """Tick every `_HURRY_POLL_S` instead of every half second for the next `seconds` (the engine
        link expects work for its tick soon: the acknowledgement of a command it just fetched)."""
        self._hurry_until = max(self._hurry_until, time.monotonic() + seconds)

    def _wait_s(self) -> float:
        return _HURRY_POLL_S if time.monotonic() < self._hurry_until else _LISTEN_POLL_S

    def close(self, timeout: float = 2 * _LISTEN_POLL_S) -> None:
        """Stop listening; waits at most `timeout` seconds (the thread is a daemon either way)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        if not self._listens:
            while not self._stop.wait(self._wait_s()):
                self._run_tick()
            return
        import psycopg  # noqa: PLC0415 (the postgres extra; only PostgreSQL engines get here)

        failures = 0
        while not self._stop.is_set():
            try:
                self._listen()
                failures = 0
            except (psycopg.Error, sa.exc.SQLAlchemyError, OSError) as exc:  # engine keeps polling
                self._listening.clear()
                delay = _RECONNECT_S[min(failures, len(_RECONNECT_S) - 1)]
                failures += 1
                _log.warning(
                    "command listener lost its connection; polling until it reconnects",
                    error=type(exc).__name__,
                    retry_in_s=delay,
                )
                self._stop.wait(delay)
                self._run_tick()

    def _run_tick(self) -> None:
        if self._tick is None:
            return
        try:
            self._tick()
        except Exception as exc:  # a chore's failure must not end the thread
            _log.warning("engine link chore failed", error=type(exc).__name__)

    def _listen(self) -> None:
        # A connection of its own, outside the pool (`detach`), in autocommit: LISTEN takes effect at
        # once and the connection is never handed to anybody else while it listens.
        raw = self._engine.raw_connection()
        conn: Any = raw.driver_connection  # psycopg.Connection (None once detached: take it first)
        raw.detach()
        try:
            conn.autocommit = True
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._woken.set()  # anything sent before LISTEN (or while reconnecting) was missed
            self._listening.set()
            while not self._stop.is_set():
                # Back to the tick at the first notification: the engine link fetches the command
                # there (`CommandRunner.fetch_if_due`), not half a second later.
                for _ in conn.notifies(timeout=self._wait_s(), stop_after=1):
                    self._woken.set()
                self._run_tick()
        finally:
            self._listening.clear()
            raw.close()
