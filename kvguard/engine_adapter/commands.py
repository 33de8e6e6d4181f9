"""Commands for engines, through the database (purges today; the admin API writes them too).

The API and engine processes share nothing but the database (ARCHITECTURE.md, data flow). A command is
a row in `engine_commands`; every engine attached to the database executes every command created after
it started (a fresh engine holds no older state, so older purges have nothing to act on) and records
an acknowledgement row per engine in `engine_command_acks` with what it did. Engines poll from their
scheduler thread, at most once a second, when a request arrives or a step runs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvguard.engine_adapter.records import PurgeKind, PurgeSelector
from kvguard.errors import ConfigError


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


class CommandQueue:
    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        _Base.metadata.create_all(engine)

    @classmethod
    def open(cls, url: str) -> CommandQueue:
        return cls(sa.create_engine(url))

    def submit_purge(self, selector: PurgeSelector, *, requested_by: str) -> int:
        if not selector.value:
            raise ConfigError("a purge needs a non-empty session, tenant, model or adapter id")
        if selector.kind is PurgeKind.SESSION and not selector.tenant_id:
            raise ConfigError("a session purge needs the tenant the session belongs to")
        with self._engine.begin() as conn:
            new_id = conn.execute(
                sa.insert(EngineCommand)
                .values(
                    kind="purge",
                    selector_kind=selector.kind.value,
                    selector_value=selector.value,
                    tenant_id=selector.tenant_id,
                    requested_by=requested_by,
                    created_at=time.time(),
                )
                .returning(EngineCommand.id)
            ).scalar_one()
            return int(new_id)

    def latest_id(self) -> int:
        with self._engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.coalesce(sa.func.max(EngineCommand.id), 0))
                ).scalar_one()
            )

    def pending_after(self, last_id: int) -> list[PurgeCommand]:
        t = EngineCommand
        with self._engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.id, t.kind, t.selector_kind, t.selector_value, t.tenant_id)
                .where(t.id > last_id)
                .order_by(t.id)
            ).all()
        return [
            PurgeCommand(
                r.id, PurgeSelector(PurgeKind(r.selector_kind), r.selector_value, r.tenant_id)
            )
            for r in rows
            if r.kind == "purge"
        ]

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
