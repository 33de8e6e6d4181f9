"""Commands for engines, through the database: purges and policy changes (CLI and admin API).

The API and engine processes share nothing but the database (ARCHITECTURE.md, data flow). A command is
a row in `engine_commands`; every engine attached to the database executes every command created after
it started (a fresh engine holds no older state, so older purges have nothing to act on, and it loads
the current policy version itself) and records an acknowledgement row per engine in
`engine_command_acks` with what it did, in counts only. Kinds: `purge` (selector kind and value) and
`policy` (`selector_value` is the policy store version to load).

Delivery. Engines poll from their scheduler thread, at most once a second (`COMMAND_POLL_S` in the
vLLM adapter), when a request arrives or a step runs. On PostgreSQL every submit also runs
`NOTIFY kvguard_commands` in its own transaction (delivered at commit, never for a rolled-back
command), and an engine runs a `CommandListener`: a daemon thread that `LISTEN`s on a dedicated
connection and only raises a flag; the scheduler thread sees the flag at its next request or step and
polls at once instead of waiting out the second. The listener never touches engine state, reconnects
with back-off when the connection drops (raising the flag after each reconnect, since notifications
sent meanwhile are lost), and stops within half a second of `close()`; being a daemon thread, it never
holds up interpreter exit. SQLite has no notifications: engines on SQLite keep polling.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvguard.engine_adapter.records import PurgeKind, PurgeSelector
from kvguard.errors import ConfigError
from kvguard.logging import get_logger

NOTIFY_CHANNEL: Final = "kvguard_commands"
_LISTEN_POLL_S: Final = 0.5  # longest wait for a notification before checking close()
_RECONNECT_S: Final = (0.5, 1.0, 2.0, 5.0)
_log = get_logger("engine.commands")


class _Base(DeclarativeBase):
    metadata = sa.MetaData()


class EngineCommand(_Base):
    __tablename__ = "engine_commands"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(sa.String(32))
    selector_kind: Mapped[str] = mapped_column(sa.String(16))
    selector_value: Mapped[str] = mapped_column(sa.String(256))
    tenant_id: Mapped[str | None] = mapped_column(sa.String(256), nullable=True)
    requested_by: Mapped[str] = mapped_column(sa.String(256))
    created_at: Mapped[float] = mapped_column(sa.Float)


class EngineCommandAck(_Base):
    __tablename__ = "engine_command_acks"

    command_id: Mapped[int] = mapped_column(sa.ForeignKey("engine_commands.id"), primary_key=True)
    engine_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    done_at: Mapped[float] = mapped_column(sa.Float)
    result: Mapped[str] = mapped_column(sa.Text)  # JSON: counts only, never identifiers of blocks


@dataclass(frozen=True, slots=True)
class PurgeCommand:
    id: int
    selector: PurgeSelector


@dataclass(frozen=True, slots=True)
class PolicyCommand:
    """Load this version from the policy store (engines never go back to an older version)."""

    id: int
    version: int


Command = PurgeCommand | PolicyCommand


class CommandQueue:
    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        _Base.metadata.create_all(engine)

    @classmethod
    def open(cls, url: str) -> CommandQueue:
        return cls(sa.create_engine(url))

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def submit_purge(self, selector: PurgeSelector, *, requested_by: str) -> int:
        if not selector.value:
            raise ConfigError("a purge needs a non-empty session, tenant, model or adapter id")
        if selector.kind is PurgeKind.SESSION and not selector.tenant_id:
            raise ConfigError("a session purge needs the tenant the session belongs to")
        return self._submit(
            kind="purge",
            selector_kind=selector.kind.value,
            selector_value=selector.value,
            tenant_id=selector.tenant_id,
            requested_by=requested_by,
        )

    def submit_policy(self, version: int, *, requested_by: str) -> int:
        """Tell every engine to load policy store version `version`."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ConfigError("a policy command needs a stored policy version (1 or more)")
        return self._submit(
            kind="policy",
            selector_kind="version",
            selector_value=str(version),
            tenant_id=None,
            requested_by=requested_by,
        )

    def _submit(self, **values: Any) -> int:
        with self._engine.begin() as conn:
            new_id = conn.execute(
                sa.insert(EngineCommand)
                .values(created_at=time.time(), **values)
                .returning(EngineCommand.id)
            ).scalar_one()
            if self._engine.dialect.name == "postgresql":
                conn.execute(sa.text(f"NOTIFY {NOTIFY_CHANNEL}"))  # sent at commit
            return int(new_id)

    def latest_id(self) -> int:
        with self._engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.coalesce(sa.func.max(EngineCommand.id), 0))
                ).scalar_one()
            )

    def pending_after(self, last_id: int) -> list[Command]:
        """Commands created after `last_id`, in order (kinds this version does not know are skipped)."""
        t = EngineCommand
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.id, t.kind, t.selector_kind, t.selector_value, t.tenant_id)
                .where(t.id > last_id)
                .order_by(t.id)
            ).all()
        out: list[Command] = []
        for r in rows:
            if r.kind == "purge":
                selector = PurgeSelector(PurgeKind(r.selector_kind), r.selector_value, r.tenant_id)
                out.append(PurgeCommand(r.id, selector))
            elif r.kind == "policy":
                out.append(PolicyCommand(r.id, int(r.selector_value)))
        return out

    def acknowledge(self, command_id: int, engine_id: str, result: dict[str, Any]) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                sa.insert(EngineCommandAck).values(
                    command_id=command_id,
                    engine_id=engine_id,
                    done_at=time.time(),
                    result=json.dumps(result, sort_keys=True),
                )
            )

    def acks(self, command_id: int) -> list[dict[str, Any]]:
        t = EngineCommandAck
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.engine_id, t.done_at, t.result).where(t.command_id == command_id)
            ).all()
        return [
            {"engine_id": r.engine_id, "done_at": r.done_at, **json.loads(r.result)} for r in rows
        ]


class CommandListener:
    """Wakes an engine's command poll on PostgreSQL `NOTIFY kvguard_commands` (module docstring)."""

    def __init__(self, engine: sa.Engine) -> None:
        if engine.dialect.name != "postgresql":
            raise ConfigError("command notifications need PostgreSQL; SQLite engines poll")
        self._engine = engine
        self._woken = threading.Event()
        self._listening = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvguard-command-listener", daemon=True
        )

    @classmethod
    def open(cls, url: str) -> CommandListener:
        return cls(sa.create_engine(url))

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

    def close(self, timeout: float = 2 * _LISTEN_POLL_S) -> None:
        """Stop listening; waits at most `timeout` seconds (the thread is a daemon either way)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
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
                for _ in conn.notifies(timeout=_LISTEN_POLL_S):
                    self._woken.set()
        finally:
            self._listening.clear()
            raw.close()
