"""The live `/metrics` of the admin API follows the Prometheus conventions (issue 13, item 3).

The real app is scraped, and its text goes through `tests/metrics_lint.py` always and through
`promtool check metrics` where promtool is on PATH (Debian: `apt-get install -y
--no-install-recommends prometheus`): before any engine reports, with an engine that has done
nothing yet, and after custody traffic has moved every histogram. The engine side is the real
`EngineReporter` writing heartbeats into the API's database (engines expose no /metrics of their
own: their figures reach Prometheus only through the API).
"""

from __future__ import annotations

import time

import pytest

from kvguard.control.commands import PurgeKind, PurgeSelector
from kvguard.control.engine_metrics import ENGINE_FIGURES, ENGINE_HISTOGRAMS, TENANT_FIGURES
from kvguard.engine_adapter.custody import Custody
from kvguard.engine_adapter.vllm.reporting import EngineReporter
from kvguard.policy import PolicySet, TenantPolicy
from tests.api.conftest import TENANTS, ApiEnv
from tests.engine_adapter.conftest import DERIVER, scope_for
from tests.metrics_lint import lint, parse, promtool_problems, values

NUM_BLOCKS = 16

# Spelled out, not read from the catalog: a figure dropped from it must fail here.
ENGINE_COUNTERS = {
    "kvguard_engine_requests_total",
    "kvguard_engine_ungoverned_requests_total",
    "kvguard_engine_untrusted_salts_total",
    "kvguard_engine_share_narrowed_total",
    "kvguard_engine_quota_deferrals_total",
    "kvguard_engine_preemptions_total",
    "kvguard_engine_commands_total",
    "kvguard_engine_prompt_tokens_total",
    "kvguard_engine_prefix_hit_tokens_total",
    "kvguard_engine_evicted_blocks_total",
    "kvguard_engine_zeroized_blocks_total",
    "kvguard_engine_zeroized_bytes_total",
    "kvguard_engine_zeroize_failures_total",
    "kvguard_engine_custody_repairs_total",
    "kvguard_engine_ledger_refusals_total",
    "kvguard_engine_ledger_submitted_events_total",
    "kvguard_engine_offload_spilled_blocks_total",
    "kvguard_engine_offload_spilled_bytes_total",
    "kvguard_engine_offload_restored_blocks_total",
    "kvguard_engine_offload_hit_tokens_total",
    "kvguard_engine_offload_restore_decisions_total",
    "kvguard_engine_offload_recompute_decisions_total",
    "kvguard_engine_offload_auth_failures_total",
    "kvguard_engine_offload_keys_shredded_total",
}
ENGINE_GAUGES = {
    "kvguard_engine_blocks_free",
    "kvguard_engine_blocks_active",
    "kvguard_engine_blocks_cached",
    "kvguard_engine_blocks_quarantined",
    "kvguard_engine_orphaned_blocks",
    "kvguard_engine_active_tokens",
    "kvguard_engine_policy_version",
    "kvguard_engine_cleanup_max_seconds",
    "kvguard_engine_heartbeat_age_seconds",
    "kvguard_engine_offload_tier_bytes",
}
ENGINE_HISTOGRAM_NAMES = {
    "kvguard_engine_cleanup_seconds",
    "kvguard_engine_zeroize_seconds",
    "kvguard_engine_zeroize_device_seconds",
    "kvguard_engine_cache_block_age_seconds",
    "kvguard_engine_offload_spill_seconds",
    "kvguard_engine_offload_restore_seconds",
}
CACHE_AGE_REASONS = ("reused", "evicted", "expired", "purged")
TENANT_SERIES = {
    "kvguard_tenant_blocks_active": "gauge",
    "kvguard_tenant_blocks_cached": "gauge",
    "kvguard_tenant_blocks_quarantined": "gauge",
    "kvguard_tenant_oldest_cached_block_age_seconds": "gauge",
    "kvguard_tenant_prompt_tokens_total": "counter",
    "kvguard_tenant_prefix_hit_tokens_total": "counter",
    "kvguard_tenant_zeroized_blocks_total": "counter",
    "kvguard_tenant_zeroized_bytes_total": "counter",
    "kvguard_tenant_offload_spilled_blocks_total": "counter",
    "kvguard_tenant_offload_spilled_bytes_total": "counter",
    "kvguard_tenant_offload_restored_blocks_total": "counter",
    "kvguard_tenant_offload_hit_tokens_total": "counter",
}
FLEET = {
    "kvguard_engines_known": "gauge",
    "kvguard_engines_live": "gauge",
    "kvguard_ledger_entries": "gauge",
    "kvguard_ledger_append_seconds": "histogram",
}


def _scrape(env: ApiEnv) -> str:
    response = env.call("auditor", "GET", "/metrics")
    assert response.status_code == 200
    return str(response.text)


def _assert_clean(text: str) -> None:
    assert [str(p) for p in lint(text)] == []
    found = promtool_problems(text)
    if found is not None:  # promtool is optional on a dev machine; CI installs it
        assert found == []


def _reporter(env: ApiEnv, engine_id: str = "e1") -> EngineReporter:
    reporter = EngineReporter(
        env.services.engines, engine_id=engine_id, tenant_tag=env.services.deriver.tenant_tag
    )
    reporter.register(model="tiny", block_size=16, num_blocks=NUM_BLOCKS)
    return reporter


def _custody() -> Custody:
    policies = PolicySet(default=TenantPolicy())  # ttl_s 3600, idle_s 600, zeroize on release
    return Custody(NUM_BLOCKS, policy=policies.policy_for, tagger=DERIVER.scope_tag)


def _labels(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def test_the_catalog_is_what_the_test_expects() -> None:
    names = {f"kvguard_engine_{f.name}": f.type.value for f in ENGINE_FIGURES} | {
        f"kvguard_engine_{h.key}": "histogram" for h in ENGINE_HISTOGRAMS
    }
    computed_by_the_api = {"kvguard_engine_heartbeat_age_seconds"}
    assert names == (
        dict.fromkeys(ENGINE_COUNTERS, "counter")
        | dict.fromkeys(ENGINE_GAUGES - computed_by_the_api, "gauge")
        | dict.fromkeys(ENGINE_HISTOGRAM_NAMES, "histogram")
    )
    tenant = {f"kvguard_tenant_{f.name}": f.type.value for f in TENANT_FIGURES}
    assert tenant.items() <= TENANT_SERIES.items()


def test_metrics_pass_the_linter_before_any_engine_reports(env: ApiEnv) -> None:
    text = _scrape(env)
    _assert_clean(text)
    families, _ = parse(text)
    declared = {name: f.type for name, f in families.items()}
    expected = (
        dict.fromkeys(ENGINE_COUNTERS, "counter")
        | dict.fromkeys(ENGINE_GAUGES, "gauge")
        | dict.fromkeys(ENGINE_HISTOGRAM_NAMES, "histogram")
        | TENANT_SERIES
        | FLEET
    )
    assert {n: declared.get(n) for n in expected} == expected  # HELP and TYPE from the start
    got = values(text)
    assert got[("kvguard_engines_known", ())] == 0.0
    assert got[("kvguard_engines_live", ())] == 0.0
    assert got[("kvguard_ledger_append_seconds_count", ())] == 0.0
    assert got[("kvguard_ledger_append_seconds_bucket", _labels(le="+Inf"))] == 0.0


def test_every_engine_and_tenant_series_is_zero_before_traffic(env: ApiEnv) -> None:
    reporter = _reporter(env)
    assert reporter.heartbeat(time.time(), _custody().summary(), {})
    text = _scrape(env)
    _assert_clean(text)
    got = values(text)
    engine = _labels(engine="e1")
    for name in ENGINE_COUNTERS | ENGINE_GAUGES - {"kvguard_engine_heartbeat_age_seconds"}:
        expected = NUM_BLOCKS if name == "kvguard_engine_blocks_free" else 0.0
        assert got[(name, engine)] == expected, name
    assert (("kvguard_engine_heartbeat_age_seconds", engine)) in got
    for name in ENGINE_HISTOGRAM_NAMES:
        reasons = CACHE_AGE_REASONS if name.endswith("cache_block_age_seconds") else (None,)
        for reason in reasons:
            labels = {"engine": "e1"} | ({"reason": reason} if reason else {})
            assert got[(f"{name}_count", _labels(**labels))] == 0.0, (name, reason)
            assert got[(f"{name}_sum", _labels(**labels))] == 0.0, (name, reason)
            buckets = [
                v
                for (n, ls), v in got.items()
                if n == f"{name}_bucket" and {k: v for k, v in ls if k != "le"} == labels
            ]
            assert len(buckets) > 5 and set(buckets) == {0.0}, (name, reason)
    for tenant in TENANTS:  # registered tenants the engine has not seen: present, zero
        labels = _labels(engine="e1", tenant_tag=env.services.deriver.tenant_tag(tenant))
        assert {got[(name, labels)] for name in TENANT_SERIES} == {0.0}, tenant
        assert tenant not in text


def test_custody_traffic_moves_every_histogram_and_stays_clean(env: ApiEnv) -> None:
    reporter, c, t0 = _reporter(env), _custody(), 1_000.0
    acme, globex = scope_for("acme"), scope_for("globex")
    c.begin("r1", acme, use_cache=True)
    c.allocate("r1", [0, 1], t0)
    c.mark_hashed([0, 1])
    c.finish("r1", t0 + 1)  # both cached, made at t0
    c.begin("r2", acme, use_cache=True)
    c.reuse("r2", [0, 1], t0 + 10, tokens_matched=32)  # reused at 10 s
    c.finish("r2", t0 + 11)
    c.begin("r3", globex, use_cache=True)
    assert c.allocate("r3", [0], t0 + 20) == (0,)  # the engine's LRU gives globex block 0: 20 s
    c.purge(PurgeSelector(PurgeKind.TENANT, "acme"), t0 + 30)  # block 1 purged at 30 s
    _zeroize(reporter, c, [0], t0 + 20.001, handover=True)
    _zeroize(reporter, c, [1], t0 + 30.5)  # cleanup 0.5 s
    c.mark_hashed([0])
    c.finish("r3", t0 + 21)  # cached for globex, made at t0 + 20
    assert c.sweep(t0 + 20 + 3601) == (0,)  # expired at 3601 s
    _zeroize(reporter, c, [0], t0 + 20 + 3601.002)  # cleanup 2 ms
    reporter.observe(c.take_events())
    reporter.cache_ages(c.take_cache_ages())
    reporter.prompt("acme", 40)
    assert reporter.heartbeat(time.time(), c.summary(), {"ledger_submitted": 9})

    text = _scrape(env)
    _assert_clean(text)
    got = values(text)
    e1 = {"engine": "e1"}

    def sample(name: str, **labels: str) -> float:
        return got[(name, _labels(**e1, **labels))]

    age = "kvguard_engine_cache_block_age_seconds"
    assert [sample(f"{age}_count", reason=r) for r in CACHE_AGE_REASONS] == [2, 1, 1, 1]
    assert sample(f"{age}_sum", reason="reused") == 20.0
    assert sample(f"{age}_bucket", reason="reused", le="5.0") == 0
    assert sample(f"{age}_bucket", reason="reused", le="15.0") == 2
    assert sample(f"{age}_sum", reason="expired") == 3601.0
    assert sample(f"{age}_bucket", reason="expired", le="3600.0") == 0
    assert sample(f"{age}_bucket", reason="expired", le="+Inf") == 1
    zeroize = "kvguard_engine_zeroize_seconds"  # 30 us per call in, seconds out
    assert sample(f"{zeroize}_count") == 3
    assert sample(f"{zeroize}_sum") == pytest.approx(90e-6)
    assert sample(f"{zeroize}_bucket", le="2.5e-05") == 0
    assert sample(f"{zeroize}_bucket", le="5e-05") == 3
    assert sample("kvguard_engine_zeroize_device_seconds_sum") == pytest.approx(15e-6)
    cleanup = "kvguard_engine_cleanup_seconds"  # release clears only (handover blocks never waited)
    assert sample(f"{cleanup}_count") == 2
    assert sample(f"{cleanup}_bucket", le="0.0025") == 1
    assert sample(f"{cleanup}_bucket", le="0.5") == 2
    assert sample("kvguard_engine_cleanup_max_seconds") == pytest.approx(0.5)
    assert sample("kvguard_engine_evicted_blocks_total") == 2  # LRU and expiry
    assert sample("kvguard_engine_zeroized_bytes_total") == 3 * 4096
    assert sample("kvguard_engine_ledger_submitted_events_total") == 9
    tag = env.services.deriver.tenant_tag("acme")
    assert sample("kvguard_tenant_prompt_tokens_total", tenant_tag=tag) == 40
    assert sample("kvguard_tenant_zeroized_bytes_total", tenant_tag=tag) == 2 * 4096
    for tenant in TENANTS:
        assert tenant not in text  # labels carry tags, never tenant ids (G6)


def _zeroize(
    reporter: EngineReporter, c: Custody, blocks: list[int], now: float, *, handover: bool = False
) -> None:
    details = {
        "bytes_cleared": 4096 * len(blocks),
        "block_count": len(blocks),
        "wall_time_us": 30.0,
        "device_time_us": 5.0,
    }
    reporter.zeroized(c, blocks, details, handover=handover, now=now)
    c.zeroized(blocks, now, details, handover=handover)


def test_two_engines_and_a_stale_one_stay_clean(env: ApiEnv) -> None:
    now = time.time()
    for engine_id in ("e1", "e2"):
        assert _reporter(env, engine_id).heartbeat(now, _custody().summary(), {})
    env.services.engines.register("old", model="tiny", block_size=16, num_blocks=16, now=now - 3600)
    text = _scrape(env)
    _assert_clean(text)
    got = values(text)
    assert got[("kvguard_engines_known", ())] == 3 and got[("kvguard_engines_live", ())] == 2
    assert 'engine="old"' not in text
    tags = [env.services.deriver.tenant_tag(t) for t in TENANTS]
    assert {
        got[("kvguard_tenant_prompt_tokens_total", _labels(engine=e, tenant_tag=t))]
        for e in ("e1", "e2")
        for t in tags
    } == {0.0}


def test_quota_rejections_are_counted_per_tenant_from_the_ledger(env: ApiEnv) -> None:
    """Issue 10, item 6: front ends record `quota.reject` entries; /metrics counts them per tenant
    tag, every registered tenant present at 0."""
    from kvguard.engine_adapter.vllm.frontquota import refusal_event  # noqa: PLC0415

    tags = {t: env.services.deriver.tenant_tag(t) for t in TENANTS}
    got = values(_scrape(env))
    for tag in tags.values():
        assert got[("kvguard_tenant_quota_rejections_total", _labels(tenant_tag=tag))] == 0.0
    first = TENANTS[0]
    for _ in range(2):
        env.services.ledger.append(refusal_event(tags[first], needed=2, held=3, cap=4))
    text = _scrape(env)
    _assert_clean(text)
    got = values(text)
    assert got[("kvguard_tenant_quota_rejections_total", _labels(tenant_tag=tags[first]))] == 2.0
    for tenant in TENANTS[1:]:
        assert got[("kvguard_tenant_quota_rejections_total", _labels(tenant_tag=tags[tenant]))] == 0
