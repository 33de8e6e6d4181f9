"""The engine registry: which engines run, what their caches hold per tenant, and scope tag owners.

Engines write, the admin API reads; both only through the database (ARCHITECTURE.md, data flow).

- `engines`: one row per engine process, registered when its KV pool is bound. The scheduler thread
  rewrites `totals` (counts and latency sums only) and `stats_at` every few seconds while the engine
  works; a keep-alive thread moves `last_seen` on while it is idle (an idle vLLM engine runs no
  scheduler code at all). `stopped_at` is set at a clean shutdown; an engine that crashed simply stops
  being seen, so readers judge liveness by `last_seen`.
- `engine_tenant_stats`: per engine and tenant, the blocks it holds now (active, cached, awaiting
  zeroization), the age of its oldest cached block, and counters since the engine started. Rewritten
  whole with each heartbeat, in the same transaction as the engine row, so a reader never sees a
  half-written picture. `tenant_tag` is the public pseudonym that metrics label with (G6).
- `scope_tags`: which tenant each `st_` scope tag belongs to, so the API can find a tenant's ledger
  entries. Insert-only; two engines announcing the same tag is the normal case, not a conflict.

Never holds salts, secrets, token ids, prompt text or block ids.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kvguard.control.db import ensure_schema, open_engine, read_connection, reading
from kvguard.control.schema import EngineRow, EngineTenantStatsRow, ScopeTagRow

Totals = Mapping[str, int | float]
# An engine whose last heartbeat is older than this is not live: purge jobs do not wait for it
# (the admin API's `engine_max_age_s` default, and what `kvguard purge` records as expected).
LIVE_MAX_AGE_S = 10.0
# A heartbeat that waits longer for SQLite's write lock fails and is retried: the scheduler must not
# stall behind another writer (`_short_busy_wait`).
_SQLITE_BUSY_S = 2.0


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """One engine as last reported. `stats_at` is None until its first heartbeat with figures."""

    engine_id: str
    model: str
    block_size: int
    num_blocks: int
    started_at: float
    last_seen: float
    stats_at: float | None
    stopped_at: float | None
    totals: Mapping[str, int | float] = field(default_factory=dict)

    def live(self, now: float, max_age_s: float) -> bool:
        return self.stopped_at is None and now - self.last_seen <= max_age_s


def expected_engines(
    engines: Sequence[EngineInfo], created_at: float, max_age_s: float
) -> set[str]:
    """Engines live at `created_at`: started by then, not stopped before it, and seen within
    `max_age_s` of it. A purge job waits for these (`kvguard.api.purge_jobs`), and whoever
    creates one records how many there are, counted at the instant the job is dated."""
    return {
        e.engine_id
        for e in engines
        if e.started_at <= created_at
        and (e.stopped_at is None or e.stopped_at >= created_at)
        and e.last_seen >= created_at - max_age_s
    }


@dataclass(frozen=True, slots=True)
class TenantCacheStats:
    """One tenant's share of one engine's cache: holdings now, counters since the engine started."""

    engine_id: str
    tenant_id: str
    tenant_tag: str
    blocks_active: int = 0
    blocks_cached: int = 0
    blocks_quarantined: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    blocks_zeroized: int = 0
    bytes_zeroized: int = 0
    tier_spilled_blocks: int = 0
    tier_spilled_bytes: int = 0
    tier_restored_blocks: int = 0
    tier_hit_tokens: int = 0
    oldest_cached_at: float | None = None
    updated_at: float = 0.0


_STAT_FIELDS = (
    "blocks_active",
    "blocks_cached",
    "blocks_quarantined",
    "prefix_hit_tokens",
    "prompt_tokens",
    "blocks_zeroized",
    "bytes_zeroized",
    "tier_spilled_blocks",
    "tier_spilled_bytes",
    "tier_restored_blocks",
    "tier_hit_tokens",
)


_ALL_ENGINES = sa.select(*EngineRow.__table__.c).order_by(EngineRow.started_at, EngineRow.engine_id)


@functools.cache
def _stats_query(*, tenant: bool, engines: bool) -> Any:
    """`EngineRegistry.tenant_stats`'s statement, built once per shape: bind parameters
    `tenant_id` and `engine_ids` (a list)."""
    t = EngineTenantStatsRow
    query = sa.select(*t.__table__.c).order_by(t.tenant_id, t.engine_id)
    if tenant:
        query = query.where(t.tenant_id == sa.bindparam("tenant_id"))
    if engines:
        query = query.where(t.engine_id.in_(sa.bindparam("engine_ids", expanding=True)))
    return query


class EngineRegistry:
    """Engine rows, per-tenant cache statistics and the scope-tag index (see the module docstring)."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        ensure_schema(engine)

    @classmethod
    def open(cls, url: str) -> EngineRegistry:
        return cls(open_engine(url))

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    # --- engine side ------------------------------------------------------------------------------

    def register(
        self, engine_id: str, *, model: str, block_size: int, num_blocks: int, now: float
    ) -> None:
        """Add (or restart) an engine row. Registering again an engine that has not stopped (a
        retry after an outage that hid the first commit) keeps its start: it was live from then,
        and a purge job dated in between waits for it (found by a review: the later start took
        it out of the job's expected engines, and the job read `done` with fewer engines than its
        request entry recorded)."""
        values = {
            "model": model,
            "block_size": block_size,
            "num_blocks": num_blocks,
            "started_at": now,
            "last_seen": now,
            "stats_at": None,
            "stopped_at": None,
            "totals": "{}",
        }
        with self._engine.begin() as conn:
            # The delete reads the prior row: a write first, so SQLite takes its write lock at once
            # (a read first, then a write, fails at once when another writer holds the lock).
            prior = conn.execute(
                sa.delete(EngineRow)
                .where(EngineRow.engine_id == engine_id)
                .returning(EngineRow.started_at, EngineRow.stopped_at)
            ).first()
            if prior is not None and prior.stopped_at is None:
                values["started_at"] = min(float(prior.started_at), now)
            conn.execute(sa.insert(EngineRow).values(engine_id=engine_id, **values))

    def heartbeat(
        self,
        engine_id: str,
        *,
        now: float,
        totals: Totals,
        tenants: Iterable[TenantCacheStats],
        new_tags: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Replace the engine's figures and add scope tags (tag, tenant id), in one transaction."""
        rows = [_tenant_row(engine_id, s, now) for s in tenants]
        tag_rows = [
            {"scope_tag": t, "tenant_id": tenant, "first_seen": now} for t, tenant in new_tags
        ]
        document = _totals_json(totals)
        with self._engine.connect() as conn, _short_busy_wait(conn), conn.begin():
            found = conn.execute(
                sa.update(EngineRow)
                .where(EngineRow.engine_id == engine_id)
                .values(last_seen=now, stats_at=now, totals=document)
            ).rowcount
            if not found:
                raise LookupError(f"engine {engine_id!r} is not registered")
            stats = EngineTenantStatsRow
            conn.execute(sa.delete(stats).where(stats.engine_id == engine_id))
            if rows:
                conn.execute(sa.insert(stats), rows)
            if tag_rows:
                conn.execute(self._insert_tags_ignoring_duplicates(), tag_rows)

    def touch(self, engine_id: str, now: float) -> None:
        """The engine is alive (keep-alive while idle); its figures stay as they are."""
        with self._engine.begin() as conn:
            conn.execute(
                sa.update(EngineRow)
                .where(EngineRow.engine_id == engine_id, EngineRow.stopped_at.is_(None))
                .values(last_seen=now)
            )

    def stop(self, engine_id: str, now: float) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                sa.update(EngineRow)
                .where(EngineRow.engine_id == engine_id)
                .values(stopped_at=now, last_seen=now)
            )

    def _insert_tags_ignoring_duplicates(self) -> Any:
        # ON CONFLICT DO NOTHING on both dialects: a concurrent insert of the same tag by another engine
        # waits for that engine's transaction and then does nothing, instead of failing ours.
        name = self._engine.dialect.name
        if name == "postgresql":
            return postgresql.insert(ScopeTagRow).on_conflict_do_nothing(
                index_elements=["scope_tag"]
            )
        if name == "sqlite":
            return sqlite.insert(ScopeTagRow).on_conflict_do_nothing(index_elements=["scope_tag"])
        raise NotImplementedError(f"the engine registry supports SQLite and PostgreSQL, not {name}")

    # --- readers ----------------------------------------------------------------------------------

    def engines(self, conn: sa.Connection | None = None) -> list[EngineInfo]:
        """Every engine ever registered, oldest first (on `conn`, a read connection the caller
        holds for several reads, or on one of its own)."""
        with reading(self._engine, conn) as c:
            return [_engine_info(r) for r in c.execute(_ALL_ENGINES).all()]

    def live_engines(self, now: float, max_age_s: float) -> list[EngineInfo]:
        """Engines not stopped and seen within `max_age_s` seconds of `now`."""
        return [e for e in self.engines() if e.live(now, max_age_s)]

    def tenant_stats(
        self, tenant_id: str | None = None, *, engine_ids: Collection[str] | None = None
    ) -> list[TenantCacheStats]:
        """Per-engine rows for one tenant (or all), optionally only for the given engines."""
        query = _stats_query(tenant=tenant_id is not None, engines=engine_ids is not None)
        params: dict[str, object] = {}
        if tenant_id is not None:
            params["tenant_id"] = tenant_id
        if engine_ids is not None:
            params["engine_ids"] = list(engine_ids)
        with read_connection(self._engine) as conn:
            rows = conn.execute(query, params).all()
        return [_tenant_stats(r) for r in rows]

    def tags_for_tenant(self, tenant_id: str) -> list[str]:
        with read_connection(self._engine) as conn:
            return list(
                conn.execute(
                    sa.select(ScopeTagRow.scope_tag)
                    .where(ScopeTagRow.tenant_id == tenant_id)
                    .order_by(ScopeTagRow.scope_tag)
                ).scalars()
            )

    def tenant_for_tag(self, tag: str) -> str | None:
        with self._engine.connect() as conn:
            return conn.execute(
                sa.select(ScopeTagRow.tenant_id).where(ScopeTagRow.scope_tag == tag)
            ).scalar_one_or_none()


@contextmanager
def _short_busy_wait(conn: sa.Connection) -> Iterator[None]:
    """On SQLite, wait at most `_SQLITE_BUSY_S` for the write lock (the scheduler thread calls
    `heartbeat`: a heartbeat that cannot get the lock fails and is retried at the next one rather
    than stall the engine behind another writer); the connection's own timeout is restored after."""
    if conn.dialect.name != "sqlite":
        yield
        return
    raw = conn.connection.driver_connection
    assert raw is not None
    previous = raw.execute("PRAGMA busy_timeout").fetchone()[0]
    raw.execute(f"PRAGMA busy_timeout={int(_SQLITE_BUSY_S * 1000)}")
    try:
        yield
    finally:
        raw.execute(f"PRAGMA busy_timeout={int(previous)}")


def _totals_json(totals: Totals) -> str:
    """Totals are counts and sums: anything else (a string, say) is refused before it is stored (G6)."""
    for name, value in totals.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(f"engine total {name!r} must be a finite number")
    return json.dumps(dict(totals), sort_keys=True)


def _tenant_row(engine_id: str, stats: TenantCacheStats, now: float) -> dict[str, Any]:
    if stats.engine_id != engine_id:
        raise ValueError("tenant statistics of another engine in this heartbeat")
    row: dict[str, Any] = {name: getattr(stats, name) for name in _STAT_FIELDS}
    return {
        **row,
        "engine_id": engine_id,
        "tenant_id": stats.tenant_id,
        "tenant_tag": stats.tenant_tag,
        "oldest_cached_at": stats.oldest_cached_at,
        "updated_at": now,
    }


def _engine_info(row: sa.Row[Any]) -> EngineInfo:
    return EngineInfo(
        engine_id=row.engine_id,
        model=row.model,
        block_size=row.block_size,
        num_blocks=row.num_blocks,
        started_at=row.started_at,
        last_seen=row.last_seen,
        stats_at=row.stats_at,
        stopped_at=row.stopped_at,
        totals=json.loads(row.totals or "{}"),
    )


def _tenant_stats(row: sa.Row[Any]) -> TenantCacheStats:
    return TenantCacheStats(
        engine_id=row.engine_id,
        tenant_id=row.tenant_id,
        tenant_tag=row.tenant_tag,
        oldest_cached_at=row.oldest_cached_at,
        updated_at=row.updated_at,
        **{name: int(getattr(row, name)) for name in _STAT_FIELDS},
    )
