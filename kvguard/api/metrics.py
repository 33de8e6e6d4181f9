"""Prometheus metrics of the fleet, read from the database at scrape time.

Engines write heartbeats (totals and per-tenant rows) to the database; a scrape turns the latest
rows into gauges: `kvguard_engine_<total>{engine}` for every engine total (block counts by state,
orphaned blocks, prefix-hit and prompt tokens, evictions, zeroization bytes and latency sums,
cleanup latency, ...), `kvguard_tenant_<stat>{engine, tenant_tag}` per tenant (labelled by the `tt_`
tag, never the tenant id), `kvguard_ledger_entries`, and the API's own ledger append latency
(`kvguard_ledger_append_seconds`, a histogram). Only live engines (recent heartbeat) are exported,
plus `kvguard_engines_live`/`kvguard_engines_known`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvguard.api.services import Services

_NAME = re.compile(r"[^a-z0-9_]")
_TENANT_STATS = (
    ("blocks_active", "Blocks held by running requests"),
    ("blocks_cached", "Blocks kept for prefix reuse"),
    ("blocks_quarantined", "Blocks waiting for zeroization"),
    ("prompt_tokens", "Prompt tokens seen"),
    ("prefix_hit_tokens", "Prefill tokens avoided by prefix-cache hits"),
    ("blocks_zeroized", "Blocks zeroized"),
    ("bytes_zeroized", "Bytes zeroized"),
)


def new_registry() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry(auto_describe=False)
    append_seconds = Histogram(
        "kvguard_ledger_append_seconds",
        "Durable ledger append latency seen by the admin API",
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
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
        yield _gauge(
            "kvguard_engines_known", "Engines that ever reported", [], [((), len(engines))]
        )
        yield _gauge(
            "kvguard_engines_live", "Engines with a recent heartbeat", [], [((), len(live))]
        )
        yield _gauge(
            "kvguard_ledger_entries",
            "Entries in the audit ledger",
            [],
            [((), services.ledger.size)],
        )
        totals: dict[str, list[tuple[tuple[str, ...], float]]] = {}
        for engine in live:
            for key, value in engine.totals.items():
                totals.setdefault(_NAME.sub("_", key.lower()), []).append(
                    ((engine.engine_id,), float(value))
                )
            age = now - engine.last_seen
            totals.setdefault("heartbeat_age_seconds", []).append(((engine.engine_id,), age))
        for key, samples in sorted(totals.items()):
            yield _gauge(f"kvguard_engine_{key}", f"Engine total {key}", ["engine"], samples)
        yield from self._tenant_metrics({e.engine_id for e in live}, now)

    def _tenant_metrics(self, live: set[str], now: float) -> Iterator[Metric]:
        rows = self._services.engines.tenant_stats(engine_ids=live) if live else []
        labels = ["engine", "tenant_tag"]
        for name, help_text in _TENANT_STATS:
            samples = [((r.engine_id, r.tenant_tag), float(getattr(r, name))) for r in rows]
            yield _gauge(f"kvguard_tenant_{name}", help_text, labels, samples)
        ages = [
            ((r.engine_id, r.tenant_tag), max(0.0, now - r.oldest_cached_at))
            for r in rows
            if r.oldest_cached_at is not None
        ]
        yield _gauge(
            "kvguard_tenant_oldest_cached_block_age_seconds",
            "Age of the tenant's oldest cached block",
            labels,
            ages,
        )


def _gauge(
    name: str, help_text: str, labels: list[str], samples: Sequence[tuple[tuple[str, ...], float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=labels)
    for values, value in samples:
        family.add_metric(list(values), value)
    return family
