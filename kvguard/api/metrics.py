"""Prometheus metrics of the fleet, read from the database at scrape time.

Engines write heartbeats (totals and per-tenant rows) to the database; a scrape turns the latest
rows into metrics named by `kvguard.control.engine_metrics`: `kvguard_engine_*{engine}` for every
engine figure (counters `_total`, gauges, and the cleanup, zeroize and cache-age histograms),
`kvguard_tenant_*{engine, tenant_tag}` per tenant (labelled by the `tt_` tag, never the tenant id,
G6), `kvguard_ledger_entries`, the API's own ledger append latency (`kvguard_ledger_append_seconds`),
and `kvguard_engines_live`/`kvguard_engines_known`.

Every series whose labels are known is exported from the start, 0 until something happens: every
figure and histogram series of every live engine (whatever its heartbeat holds), and the tenant
series of every registered tenant on every live engine. Only live engines (recent heartbeat) are
exported; a figure an engine reports that this catalog does not name stays out of /metrics (it is
still in `/v1/cache/engines`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvguard.audit import schema as ledger_schema
from kvguard.audit.events import EventKind
from kvguard.control.engine_metrics import (
    ENGINE_FIGURES,
    ENGINE_HISTOGRAMS,
    TENANT_FIGURES,
    Figure,
    MetricType,
    read_histogram,
)
from kvguard.control.engines import EngineInfo, TenantCacheStats

if TYPE_CHECKING:
    from kvguard.api.services import Services

Samples = Sequence[tuple[Sequence[str], float]]
_TENANT_PAGE = 1000


def new_registry() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry(auto_describe=False)
    append_seconds = Histogram(
        "kvguard_ledger_append_seconds",
        "Durable ledger append latency seen by the admin API",
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        unit="seconds",
        registry=registry,
    )
    return registry, append_seconds


class FleetCollector(Collector):
    def __init__(self, services: Services) -> None:
        self._services = services

    def collect(self) -> Iterator[Metric]:
        services = self._services
        now, max_age = services.clock(), services.config.engine_max_age_s
        engines = services.engines.engines()
        live = [e for e in engines if e.live(now, max_age)]
        yield _family(
            "kvguard_engines_known", "Engines that ever reported", [], [((), len(engines))]
        )
        yield _family(
            "kvguard_engines_live", "Engines with a recent heartbeat", [], [((), len(live))]
        )
        yield _family(
            "kvguard_ledger_entries",
            "Entries in the audit ledger",
            [],
            [((), services.ledger.size)],
        )
        yield _family(
            "kvguard_engine_heartbeat_age_seconds",
            "Time since the engine's last heartbeat or keep-alive",
            ["engine"],
            [((e.engine_id,), max(0.0, now - e.last_seen)) for e in live],
            unit="seconds",
        )
        yield from _engine_figures(live)
        yield from _engine_histograms(live)
        yield from self._tenant_metrics([e.engine_id for e in live], now)
        yield self._quota_rejections()

    def _quota_rejections(self) -> Metric:
        """`quota.reject` ledger entries per tenant tag (front ends record them: `frontquota`),
        every registered tenant present from the start. A read of the `(kind, idx)` index."""
        counts = dict.fromkeys(self._tenant_tags(), 0)
        e = ledger_schema.entries.c
        stmt = (
            sa.select(e.scope_tag, sa.func.count())
            .where(e.kind == EventKind.QUOTA_REJECT.value)
            .group_by(e.scope_tag)
        )
        with self._services.ledger.store.engine.connect() as conn:
            for tag, count in conn.execute(stmt):
                if tag is not None:
                    counts[str(tag)] = counts.get(str(tag), 0) + int(count)
        family = CounterMetricFamily(
            "kvguard_tenant_quota_rejections",
            "Requests the front end refused because the tenant's quota was full",
            labels=["tenant_tag"],
        )
        for tag in sorted(counts):
            family.add_metric([tag], counts[tag])
        return family

    def _tenant_metrics(self, live: list[str], now: float) -> Iterator[Metric]:
        rows = self._services.engines.tenant_stats(engine_ids=live) if live else []
        by_key = {(r.engine_id, r.tenant_tag): r for r in rows}
        tags = self._tenant_tags() if live else []
        for engine_id in live:  # registered tenants the engine has not seen yet: all zero
            for tag in tags:
                by_key.setdefault((engine_id, tag), TenantCacheStats(engine_id, "", tag))
        keys = sorted(by_key)
        labels = ["engine", "tenant_tag"]
        for figure in TENANT_FIGURES:
            samples = [(k, float(getattr(by_key[k], figure.key))) for k in keys]
            yield _figure("kvguard_tenant_", figure, labels, samples)
        ages = [
            (k, max(0.0, now - at) if (at := by_key[k].oldest_cached_at) is not None else 0.0)
            for k in keys
        ]
        yield _family(
            "kvguard_tenant_oldest_cached_block_age_seconds",
            "Age of the tenant's oldest cached block (0: none cached)",
            labels,
            ages,
            unit="seconds",
        )

    def _tenant_tags(self) -> list[str]:
        """The `tt_` tag of every registered tenant (paged: a scrape must not load one huge list)."""
        tags: list[str] = []
        after: str | None = None
        while True:
            page = self._services.tenants.list(after=after, limit=_TENANT_PAGE)
            tags.extend(self._services.deriver.tenant_tag(t.tenant_id) for t in page)
            if len(page) < _TENANT_PAGE:
                return tags
            after = page[-1].tenant_id


def _engine_figures(live: list[EngineInfo]) -> Iterator[Metric]:
    for figure in ENGINE_FIGURES:
        samples = [((e.engine_id,), _number(e.totals, figure.key)) for e in live]
        yield _figure("kvguard_engine_", figure, ["engine"], samples)


def _engine_histograms(live: list[EngineInfo]) -> Iterator[Metric]:
    for spec in ENGINE_HISTOGRAMS:
        labels = ["engine"] + ([spec.label] if spec.label else [])
        family = HistogramMetricFamily(
            f"kvguard_engine_{spec.key}", spec.help, labels=labels, unit=spec.unit
        )
        for engine in live:
            for values in spec.series():
                reading = read_histogram(engine.totals, spec, values)
                buckets = [(repr(le), n) for le, n in reading.buckets]
                family.add_metric(
                    [engine.engine_id, *values],
                    [*buckets, ("+Inf", reading.count)],
                    sum_value=reading.sum,
                )
        yield family


def _number(totals: Mapping[str, int | float], key: str) -> float:
    value = totals.get(key, 0)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _figure(prefix: str, figure: Figure, labels: list[str], samples: Samples) -> Metric:
    if figure.type is MetricType.COUNTER:
        counter = CounterMetricFamily(
            prefix + figure.name, figure.help, labels=labels, unit=figure.unit
        )
        for values, value in samples:
            counter.add_metric(list(values), value)
        return counter
    return _family(prefix + figure.name, figure.help, labels, samples, unit=figure.unit)


def _family(
    name: str, help_text: str, labels: list[str], samples: Samples, *, unit: str = ""
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=labels, unit=unit)
    for values, value in samples:
        family.add_metric(list(values), value)
    return family
