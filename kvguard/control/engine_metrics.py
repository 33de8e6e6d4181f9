"""What an engine's heartbeat figures mean to Prometheus, and how its histograms travel.

Engines write their figures into `engines.totals` (a flat JSON object of numbers,
`kvguard.control.engines`) and per-tenant rows; the admin API turns them into Prometheus metrics at
scrape time (`kvguard.api.metrics`). This module is the contract between the two: for every figure,
its Prometheus name, type, unit and help text, and the histograms an engine keeps (buckets chosen
for the ranges measured in docs/benchmarks.md).

Names follow https://prometheus.io/docs/practices/naming/ and `promtool check metrics`: counters
end in `_total`, durations are in seconds and sizes in bytes, and only histograms own `_bucket`,
`_sum` and `_count`. The API exports every figure here for every live engine, 0 until the engine
reports it, so no series appears only after its first event.

A histogram travels in `totals` as plain numbers: `<series>.le=<bound>` (cumulative count of
observations <= bound), `<series>.sum` and `<series>.count`, where `<series>` is the histogram's key,
or `<key>.<label value>` for a labelled one. The bounds are written out, so an API reads what the
engine measured even if the two disagree on the buckets. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final


class MetricType(StrEnum):
    COUNTER = "counter"  # since the engine started; an engine restart is a new `engine` label
    GAUGE = "gauge"


class CacheExit(StrEnum):
    """Why a cached block's age was taken: its bytes served a prefix hit, or its cached life ended."""

    REUSED = "reused"  # a prefix hit served it (it stays cached after the request)
    EVICTED = "evicted"  # the engine's LRU handed it to a new allocation
    EXPIRED = "expired"  # its owner's retention policy (ttl_s, idle_s) retired it
    PURGED = "purged"  # a purge command quarantined it


@dataclass(frozen=True, slots=True)
class Figure:
    """One number an engine reports. `name` is the Prometheus name after the `kvguard_engine_` or
    `kvguard_tenant_` prefix; `unit` is the base unit the name ends in ("" for counts)."""

    key: str  # in the totals document, or the `TenantCacheStats` field
    name: str
    type: MetricType
    help: str
    unit: str = ""


_C, _G = MetricType.COUNTER, MetricType.GAUGE

ENGINE_FIGURES: Final = (
    Figure("requests", "requests_total", _C, "Requests the engine's scheduler received"),
    Figure(
        "ungoverned",
        "ungoverned_requests_total",
        _C,
        "Requests without a kvguard scope envelope (run private, no prefix caching)",
    ),
    Figure(
        "untrusted_salts",
        "untrusted_salts_total",
        _C,
        "Requests whose cache salt was not derived for their scope (prefix caching turned off)",
    ),
    Figure(
        "share_narrowed",
        "share_narrowed_total",
        _C,
        "Share-group requests narrowed to their tenant's own scope",
    ),
    Figure(
        "quota_deferred",
        "quota_deferrals_total",
        _C,
        "Requests held back by their tenant's block quota (counted once per request)",
    ),
    Figure("preemptions", "preemptions_total", _C, "Requests preempted by the scheduler"),
    Figure("commands", "commands_total", _C, "Control commands (purges, policy versions) run"),
    Figure("prompt_tokens", "prompt_tokens_total", _C, "Prompt tokens the scheduler saw"),
    Figure(
        "prefix_hit_tokens",
        "prefix_hit_tokens_total",
        _C,
        "Prompt tokens served from the prefix cache (prefill avoided)",
    ),
    Figure(
        "evictions",
        "evicted_blocks_total",
        _C,
        "Cached blocks whose cached life ended by engine LRU eviction or expiry",
    ),
    Figure(
        "blocks_zeroized", "zeroized_blocks_total", _C, "Blocks zeroized (release and handover)"
    ),
    Figure("bytes_zeroized", "zeroized_bytes_total", _C, "KV cache bytes zeroized", "bytes"),
    Figure(
        "zeroize_failures",
        "zeroize_failures_total",
        _C,
        "Zeroization calls that failed (their blocks stay quarantined)",
    ),
    Figure(
        "ledger_refusals",
        "ledger_refusals_total",
        _C,
        "Times the audit ledger refused custody events (kept and recorded late; no new requests "
        "start meanwhile)",
    ),
    Figure(
        "custody_repairs",
        "custody_repairs_total",
        _C,
        "Custody repairs: blocks the engine handed over that custody could not account for",
    ),
    Figure(
        "ledger_submitted",
        "ledger_submitted_events_total",
        _C,
        "Custody events submitted to the audit ledger",
    ),
    Figure(
        "tier_spilled_blocks",
        "offload_spilled_blocks_total",
        _C,
        "Evicted cached blocks kept encrypted in the offload tier",
    ),
    Figure(
        "tier_spilled_bytes",
        "offload_spilled_bytes_total",
        _C,
        "Ciphertext bytes written to the offload tier",
        "bytes",
    ),
    Figure(
        "tier_restored_blocks",
        "offload_restored_blocks_total",
        _C,
        "Blocks restored from the offload tier (authenticated, decrypted, copied in)",
    ),
    Figure(
        "tier_hit_tokens",
        "offload_hit_tokens_total",
        _C,
        "Prompt tokens served from the offload tier (prefill avoided)",
    ),
    Figure(
        "tier_restore_decisions",
        "offload_restore_decisions_total",
        _C,
        "Requests whose offload tier hit was restored",
    ),
    Figure(
        "tier_recompute_decisions",
        "offload_recompute_decisions_total",
        _C,
        "Requests whose offload tier hit was recomputed instead (restore measured slower)",
    ),
    Figure(
        "tier_auth_failures",
        "offload_auth_failures_total",
        _C,
        "Offload tier entries that failed authentication (recomputed, never served)",
    ),
    Figure(
        "tier_keys_shredded",
        "offload_keys_shredded_total",
        _C,
        "Offload data keys destroyed (purge, expiry, disable, policy)",
    ),
    Figure(
        "tier_bytes", "offload_tier_bytes", _G, "Ciphertext bytes the offload tier holds", "bytes"
    ),
    Figure("blocks_free", "blocks_free", _G, "KV blocks in the free pool"),
    Figure("blocks_active", "blocks_active", _G, "KV blocks held by running requests"),
    Figure("blocks_cached", "blocks_cached", _G, "KV blocks kept for prefix reuse"),
    Figure("blocks_quarantined", "blocks_quarantined", _G, "KV blocks waiting for zeroization"),
    Figure(
        "orphaned_blocks",
        "orphaned_blocks",
        _G,
        "Free blocks still holding a previous owner's bytes (cleared on handover)",
    ),
    Figure("active_tokens", "active_tokens", _G, "Computed tokens of the running requests"),
    Figure(
        "policy_version",
        "policy_version",
        _G,
        "Version of the policy set in force (0 until the engine loads one from the database)",
    ),
    Figure(
        "cleanup_max_seconds",
        "cleanup_max_seconds",
        _G,
        "Longest cleanup (quarantine to zeroized) since the engine started",
        "seconds",
    ),
)

TENANT_FIGURES: Final = (
    Figure("blocks_active", "blocks_active", _G, "Blocks held by the tenant's running requests"),
    Figure("blocks_cached", "blocks_cached", _G, "Blocks of the tenant kept for prefix reuse"),
    Figure(
        "blocks_quarantined", "blocks_quarantined", _G, "Blocks of the tenant awaiting zeroization"
    ),
    Figure("prompt_tokens", "prompt_tokens_total", _C, "Prompt tokens of the tenant's requests"),
    Figure(
        "prefix_hit_tokens",
        "prefix_hit_tokens_total",
        _C,
        "Prompt tokens of the tenant served from the prefix cache",
    ),
    Figure("blocks_zeroized", "zeroized_blocks_total", _C, "Blocks of the tenant's data zeroized"),
    Figure(
        "bytes_zeroized", "zeroized_bytes_total", _C, "Bytes of the tenant's data zeroized", "bytes"
    ),
    Figure(
        "tier_spilled_blocks",
        "offload_spilled_blocks_total",
        _C,
        "Evicted blocks of the tenant kept in the encrypted offload tier",
    ),
    Figure(
        "tier_spilled_bytes",
        "offload_spilled_bytes_total",
        _C,
        "Ciphertext bytes of the tenant written to the offload tier",
        "bytes",
    ),
    Figure(
        "tier_restored_blocks",
        "offload_restored_blocks_total",
        _C,
        "Blocks of the tenant restored from the offload tier",
    ),
    Figure(
        "tier_hit_tokens",
        "offload_hit_tokens_total",
        _C,
        "Prompt tokens of the tenant served from the offload tier",
    ),
)


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    """An engine histogram: exported as `kvguard_engine_<key>` with the `engine` label, plus
    `label` (one series per value in `label_values`, all known up front) when set."""

    key: str
    help: str
    buckets: tuple[float, ...]
    label: str | None = None
    label_values: tuple[str, ...] = ()
    unit: str = "seconds"

    def series(self) -> tuple[tuple[str, ...], ...]:
        """Label values of every series (`()` for the one series of an unlabelled histogram)."""
        return tuple((v,) for v in self.label_values) if self.label else ((),)

    def series_key(self, label_value: tuple[str, ...] = ()) -> str:
        return ".".join((self.key, *label_value))


# Quarantine to zeroized: at least one engine step (ms), seconds when an idle engine waits for its
# waker (WAKE_CHECK_S), longer only when something is wrong.
CLEANUP: Final = HistogramSpec(
    "cleanup_seconds",
    "Time from a block entering quarantine to the worker reporting it zeroized",
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
# One zeroize call: 5 us (one block, GPU kernel) to ~100 ms (thousands of blocks per layer loop,
# docs/benchmarks.md, zeroization table); CPU clears of a few blocks take ~25 us.
_ZEROIZE_BUCKETS: Final = (
    0.000005,
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
)
ZEROIZE: Final = HistogramSpec(
    "zeroize_seconds",
    "Host time of one zeroize call (clear and verification read-back)",
    _ZEROIZE_BUCKETS,
)
ZEROIZE_DEVICE: Final = HistogramSpec(
    "zeroize_device_seconds",
    "GPU time of one zeroize call's clearing launch (CUDA events; no observations off the GPU)",
    _ZEROIZE_BUCKETS,
)
# Retention defaults are ttl_s 3600 and idle_s 600 (docs/policy.md); prefix hits within a burst
# come sub-second.
CACHE_AGE: Final = HistogramSpec(
    "cache_block_age_seconds",
    "Age of a cached block's bytes when a prefix hit reused them or its cached life ended",
    (
        0.1,
        0.5,
        1.0,
        5.0,
        15.0,
        30.0,
        60.0,
        120.0,
        300.0,
        600.0,
        1800.0,
        3600.0,
        7200.0,
        21600.0,
        86400.0,
    ),
    label="reason",
    label_values=tuple(CacheExit),
)
# The offload tier (docs/offload.md): one step's spill of one scope tag's blocks, one request's
# restore. A CPU block of the tiny test model takes ~100-300 us; an 8B model's 2 MiB bf16 block on
# a GPU host is copied and encrypted in a few ms (docs/benchmarks.md).
OFFLOAD_SPILL: Final = HistogramSpec(
    "offload_spill_seconds",
    "Host time to read out and encrypt one step's spilled blocks of one scope",
    _ZEROIZE_BUCKETS,
)
OFFLOAD_RESTORE: Final = HistogramSpec(
    "offload_restore_seconds",
    "Host time to authenticate, decrypt and copy in one request's restored blocks",
    _ZEROIZE_BUCKETS,
)
ENGINE_HISTOGRAMS: Final = (
    CLEANUP,
    ZEROIZE,
    ZEROIZE_DEVICE,
    CACHE_AGE,
    OFFLOAD_SPILL,
    OFFLOAD_RESTORE,
)


class BucketCounts:
    """The engine's side of one histogram series: observations per bucket, their sum and count."""

    __slots__ = ("_bounds", "_counts", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError("histogram bounds must be distinct and ascending")
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last slot: above every bound (+Inf only)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count `value`; a NaN or infinite one is dropped (heartbeats refuse non-finite totals, so
        one bad reading would otherwise stop every later heartbeat)."""
        if not math.isfinite(value):
            return
        self._counts[bisect_left(self._bounds, value)] += 1  # `le`: value <= bound
        self.count += 1
        self.sum += value

    def totals(self, series_key: str) -> dict[str, float]:
        """This series as totals entries (cumulative counts per bound, sum, count)."""
        out: dict[str, float] = {}
        running = 0
        for bound, n in zip(self._bounds, self._counts, strict=False):
            running += n
            out[f"{series_key}.le={bound!r}"] = running
        out[f"{series_key}.sum"] = self.sum
        out[f"{series_key}.count"] = self.count
        return out


@dataclass(frozen=True, slots=True)
class HistogramReading:
    """One series as read from totals: cumulative (bound, count) pairs, sum and count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float


def read_histogram(
    totals: Mapping[str, int | float], spec: HistogramSpec, label_value: tuple[str, ...] = ()
) -> HistogramReading:
    """The series as the engine wrote it; empty (every bucket 0) when it wrote nothing yet."""
    prefix = spec.series_key(label_value) + "."
    found: list[tuple[float, float]] = []
    for key, value in totals.items():
        if not key.startswith(prefix + "le="):
            continue
        try:
            bound = float(key[len(prefix) + 3 :])
        except ValueError:
            continue  # not a bound this reader understands; the rest of the series still counts
        if math.isfinite(bound):  # +Inf is the count, added by the exporter
            found.append((bound, float(value)))
    if not found:
        return HistogramReading(tuple((b, 0.0) for b in spec.buckets), 0.0, 0.0)
    found.sort()
    count = float(totals.get(prefix + "count", found[-1][1]))
    return HistogramReading(tuple(found), float(totals.get(prefix + "sum", 0.0)), count)
