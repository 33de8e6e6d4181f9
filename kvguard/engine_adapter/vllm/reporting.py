"""Cache statistics of one engine, and its heartbeats to the engine registry (`kvguard.control.engines`).

`EngineReporter` counts, per tenant, the prompt tokens and prefix-hit tokens the scheduler saw and the
blocks (and bytes) of the tenant's data that the worker zeroized, plus engine-wide histograms
(`kvguard.control.engine_metrics`, which also names every figure for Prometheus): zeroization time
per call as measured by the worker, cleanup time, from a block entering quarantine to the worker
reporting it clear, and the age of cached blocks when a prefix hit reuses them or their cached life
ends. Every `HEARTBEAT_S` the scheduler thread takes the figures (with a custody summary) and hands
their write to the engine link's thread (`heartbeat_soon`): the registry row, the per-tenant rows and
the scope tags first seen since the last heartbeat are written there in one transaction, so the step
loop never waits for a database round trip. `heartbeat` writes on the caller's thread (reports on
demand, and the last one at shutdown, after which no deferred write lands).

Statistics are observability, not evidence (the ledger is): a heartbeat that fails is logged (the
error's type only, never its text, which could carry the database URL) and retried at the next one,
and the engine carries on. Buffered tags stay buffered until a heartbeat succeeds.

All methods run in the scheduler thread except deferred heartbeat writes and `keepalive`, which the
engine link's thread runs every
`HEARTBEAT_S` (`EngineLink.every`) and which only moves the engine row's `last_seen` on: an idle vLLM
engine runs no scheduler code, and must not look dead to the API. The reporter owns no connection:
the registry is the engine link's.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa

from kvguard.control.engine_metrics import (
    CACHE_AGE,
    CLEANUP,
    ENGINE_HISTOGRAMS,
    OFFLOAD_RESTORE,
    OFFLOAD_SPILL,
    ZEROIZE,
    ZEROIZE_DEVICE,
    BucketCounts,
    HistogramSpec,
)
from kvguard.control.engines import EngineRegistry, TenantCacheStats
from kvguard.engine_adapter.custody import Custody
from kvguard.engine_adapter.records import CacheAge, CustodyEvent, EventKind, PoolSummary
from kvguard.logging import get_logger

HEARTBEAT_S: Final = 2.0
ENGINE_COUNTERS: Final = (
    "requests",
    "untrusted_salts",
    "ungoverned",
    "reused_tokens",
    "blocks_zeroized",
    "preemptions",
    "commands",
    "zeroize_failures",
    "custody_repairs",
    "ledger_refusals",
    "share_narrowed",
    "quota_deferred",
    *(
        f"tier_{name}"
        for name in (
            "spilled_blocks",
            "spilled_bytes",
            "restored_blocks",
            "hit_tokens",
            "restore_decisions",
            "recompute_decisions",
            "auth_failures",
            "load_misses",
            "keys_shredded",
            "evicted_entries",
            "expired_entries",
            "spill_us",
            "restore_us",
        )
    ),
)
_log = get_logger("vllm.reporting")


@dataclass(frozen=True, slots=True)
class _Beat:
    """One heartbeat's figures, taken on the scheduler thread."""

    now: float
    totals: dict[str, int | float]
    tenants: list[TenantCacheStats]
    tags: dict[str, str]
    final: bool = False


class EngineReporter:
    """Per-tenant counters and heartbeats for one engine (see the module docstring)."""

    def __init__(
        self,
        registry: EngineRegistry,
        *,
        engine_id: str,
        tenant_tag: Callable[[str], str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.engine_id = engine_id
        self._tenant_tag = tenant_tag
        self._clock = clock
        self._identity: dict[str, Any] = {}
        self._registered = False
        self._last_beat = float("-inf")
        # Scope tag -> tenant, first seen and not yet written by a heartbeat. Shared with the link's
        # thread (deferred writes remove what they wrote), hence the lock.
        self._tags: dict[str, str] = {}
        self._tags_lock = threading.Lock()
        self.prompt_tokens: Counter[str] = Counter()
        self.prefix_hit_tokens: Counter[str] = Counter()
        self.blocks_zeroized: Counter[str] = Counter()
        self.bytes_zeroized: Counter[str] = Counter()
        self.tier: dict[str, Counter[str]] = {}  # tenant -> offload tier figures (TenantCacheStats)
        self.stats: dict[str, int] = dict.fromkeys(ENGINE_COUNTERS, 0)  # kept by the scheduler
        self.counts: Counter[str] = Counter(evictions=0, bytes_zeroized=0)  # engine-wide, kept here
        self.histograms: dict[str, BucketCounts] = {
            spec.series_key(labels): BucketCounts(spec.buckets)
            for spec in ENGINE_HISTOGRAMS
            for labels in spec.series()
        }
        self.cleanup_max_s = 0.0
        self.heartbeats = 0
        self._write_lock = threading.Lock()  # one write at a time; none after the last one
        self._closed = False
        self._written_at = float("-inf")  # the figures' time of the newest heartbeat written

    # --- what the scheduler reports -----------------------------------------------------------

    def register(self, *, model: str, block_size: int, num_blocks: int) -> None:
        self._identity = {"model": model, "block_size": block_size, "num_blocks": num_blocks}
        self._try_register()

    def keepalive(self) -> None:
        """Move `last_seen` on (the link's thread, every HEARTBEAT_S); nothing before `register`."""
        if self._registered:
            self.registry.touch(self.engine_id, self._clock())

    def new_tag(self, tag: str, tenant: str) -> None:
        with self._tags_lock:
            self._tags[tag] = tenant

    def prompt(self, tenant: str, tokens: int) -> None:
        self.prompt_tokens[tenant] += tokens

    def prefix_hit(self, tenant: str, tokens: int) -> None:
        self.prefix_hit_tokens[tenant] += tokens

    def tier_figure(self, tenant: str, figure: str, amount: int) -> None:
        """One of the tenant's offload tier figures (`tier_spilled_blocks`, ...) grows."""
        self.tier.setdefault(tenant, Counter())[figure] += amount

    def observe(self, events: Iterable[CustodyEvent]) -> None:
        for event in events:
            kind = event.kind
            if kind is EventKind.EVICT:
                self.counts["evictions"] += len(event.block_ids)
            elif kind is EventKind.SPILL:
                self._observe_us(OFFLOAD_SPILL, event.details.get("spill_us"))
            elif kind is EventKind.RESTORE and event.details.get("decision") == "restore":
                self._observe_us(OFFLOAD_RESTORE, event.details.get("restore_us"))

    def cache_ages(self, ages: Iterable[CacheAge]) -> None:
        for age in ages:
            self._observe(CACHE_AGE, age.age_s, (age.reason.value,))

    def zeroized(
        self,
        custody: Custody,
        blocks: Iterable[int],
        details: Mapping[str, Any],
        *,
        handover: bool,
        now: float,
    ) -> None:
        """Call before `custody.zeroized`: the cleared blocks still know their owner there."""
        ids = list(blocks)
        per_block = _bytes_per_block(details)
        for b in ids:
            if handover:
                previous = custody.handover_owner(b)
                tenant = previous.tenant_id if previous is not None else None
            else:
                rec = custody.record(b)
                tenant = rec.owner.tenant_id if rec.owner is not None else None
                if rec.quarantined_at is not None:
                    self._cleanup(now - rec.quarantined_at)
            if tenant is not None:
                self.blocks_zeroized[tenant] += 1
                self.bytes_zeroized[tenant] += per_block or 0
        self.counts["bytes_zeroized"] += (per_block or 0) * len(ids)
        for name, spec in (("wall_time_us", ZEROIZE), ("device_time_us", ZEROIZE_DEVICE)):
            value = details.get(name)  # the evidence's microseconds; Prometheus wants seconds
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._observe(spec, float(value) / 1e6)

    def _cleanup(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self._observe(CLEANUP, seconds)
        self.cleanup_max_s = max(self.cleanup_max_s, seconds)

    def _observe_us(self, spec: HistogramSpec, micros: object) -> None:
        if isinstance(micros, int) and not isinstance(micros, bool):
            self._observe(spec, micros / 1e6)

    def _observe(self, spec: HistogramSpec, value: float, labels: tuple[str, ...] = ()) -> None:
        if math.isfinite(value):  # a NaN would make every later heartbeat fail (`_totals_json`)
            self.histograms[spec.series_key(labels)].observe(max(0.0, value))

    # --- heartbeats ---------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return now - self._last_beat >= HEARTBEAT_S

    @property
    def next_beat_at(self) -> float:
        """When `due` turns true (it stays true until the figures are taken again)."""
        return self._last_beat + HEARTBEAT_S

    def heartbeat(
        self, now: float, summary: PoolSummary, counters: Mapping[str, int | float]
    ) -> bool:
        """Write the figures now; False (logged, retried next time) when the database refused them."""
        return self._write(self._beat(now, summary, counters))

    def heartbeat_soon(
        self,
        now: float,
        summary: PoolSummary,
        counters: Mapping[str, int | float],
        defer: Callable[[Callable[[], object]], None],
    ) -> None:
        """Take the figures now and have `defer` write them (the engine link's `call_soon`)."""
        beat = self._beat(now, summary, counters)
        defer(lambda: self._write(beat))

    def _beat(
        self,
        now: float,
        summary: PoolSummary,
        counters: Mapping[str, int | float],
        final: bool = False,
    ) -> _Beat:
        self._last_beat = now
        with self._tags_lock:  # a copy: they leave the buffer only once a heartbeat wrote them
            tags = dict(self._tags)
        return _Beat(now, self._totals(summary, counters), self._tenant_rows(summary), tags, final)

    def _write(self, beat: _Beat) -> bool:
        with self._write_lock:
            if self._closed and not beat.final:
                return False  # the last heartbeat has been written: an older one must not follow
            if beat.now < self._written_at:
                # A deferred heartbeat written after a newer one (`report_now`): its figures are
                # stale and must not replace the newer ones (its tags are still buffered).
                return True
            self._closed = self._closed or beat.final
            try:
                if not self._registered:
                    self._try_register(raise_errors=True)
                self.registry.heartbeat(
                    self.engine_id,
                    now=beat.now,
                    totals=beat.totals,
                    tenants=beat.tenants,
                    new_tags=list(beat.tags.items()),
                )
            except (sa.exc.SQLAlchemyError, OSError, LookupError) as exc:
                self._registered = self._registered and not isinstance(exc, LookupError)
                _log.warning("engine heartbeat failed; retrying", error=type(exc).__name__)
                return False
            self.heartbeats += 1
            self._written_at = beat.now
            with self._tags_lock:  # written (the registry ignores a tag it already has)
                for tag in beat.tags:
                    self._tags.pop(tag, None)
            return True

    def close(self, now: float, summary: PoolSummary, counters: Mapping[str, int | float]) -> None:
        """Last heartbeat and `stopped_at`; no deferred heartbeat is written after it. Never raises."""
        if not self._identity:
            return
        if self._write(self._beat(now, summary, counters, final=True)):
            try:
                self.registry.stop(self.engine_id, now)
            except sa.exc.SQLAlchemyError as exc:
                _log.warning("could not record the engine's stop", error=type(exc).__name__)

    def _try_register(self, *, raise_errors: bool = False) -> None:
        try:
            self.registry.register(self.engine_id, now=self._clock(), **self._identity)
            self._registered = True
        except sa.exc.SQLAlchemyError as exc:
            if raise_errors:
                raise
            _log.warning("engine registration failed; retrying", error=type(exc).__name__)

    def _totals(
        self, summary: PoolSummary, counters: Mapping[str, int | float]
    ) -> dict[str, int | float]:
        histograms: dict[str, float] = {}
        for key, counts in self.histograms.items():
            histograms.update(counts.totals(key))
        return {
            **self.stats,
            **counters,
            **self.counts,
            **histograms,
            "prompt_tokens": self.prompt_tokens.total(),
            "prefix_hit_tokens": self.prefix_hit_tokens.total(),
            "blocks_free": summary.free,
            "blocks_active": summary.active,
            "blocks_cached": summary.cached,
            "blocks_quarantined": summary.quarantined,
            "orphaned_blocks": summary.residue,
            "cleanup_max_seconds": self.cleanup_max_s,
        }

    def _tenant_rows(self, summary: PoolSummary) -> list[TenantCacheStats]:
        tenants = (
            set(summary.tenants)
            | set(self.prompt_tokens)
            | set(self.prefix_hit_tokens)
            | set(self.blocks_zeroized)
            | set(self.tier)
        )
        rows = []
        for tenant in sorted(tenants):
            held = summary.tenants.get(tenant)
            rows.append(
                TenantCacheStats(
                    engine_id=self.engine_id,
                    tenant_id=tenant,
                    tenant_tag=self._tenant_tag(tenant),
                    blocks_active=held.active if held else 0,
                    blocks_cached=held.cached if held else 0,
                    blocks_quarantined=held.quarantined if held else 0,
                    prefix_hit_tokens=self.prefix_hit_tokens[tenant],
                    prompt_tokens=self.prompt_tokens[tenant],
                    blocks_zeroized=self.blocks_zeroized[tenant],
                    bytes_zeroized=self.bytes_zeroized[tenant],
                    oldest_cached_at=held.oldest_cached_at if held else None,
                    **self.tier.get(tenant, Counter()),
                )
            )
        return rows


def _bytes_per_block(details: Mapping[str, Any]) -> int | None:
    cleared, count = details.get("bytes_cleared"), details.get("block_count")
    if isinstance(cleared, int) and isinstance(count, int) and count > 0:
        return cleared // count
    return None
