"""Cache state and /metrics: per tenant and engine from the engines' heartbeats; a tenant sees only
its own rows and never metrics; metrics carry tenant tags, never tenant ids."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvguard.control.engines import TenantCacheStats
from tests.api.conftest import ApiEnv


def _report(env: ApiEnv, engine_id: str, *, now: float, stats: dict[str, dict[str, int]]) -> None:
    registry = env.services.engines
    registry.register(engine_id, model="tiny", block_size=32, num_blocks=64, now=now)
    rows = [
        TenantCacheStats(
            engine_id=engine_id,
            tenant_id=tenant,
            tenant_tag=env.services.deriver.tenant_tag(tenant),
            oldest_cached_at=now - 30.0,
            **values,
        )
        for tenant, values in stats.items()
    ]
    totals = {
        "blocks_free": 40,
        "blocks_cached": 20,
        "orphaned_blocks": 0,
        "cleanup_max_seconds": 0.004,
    }
    registry.heartbeat(engine_id, now=now, totals=totals, tenants=rows)


def _fleet(env: ApiEnv) -> None:
    now = time.time()
    _report(
        env,
        "eng-a",
        now=now,
        stats={
            "acme": {"blocks_cached": 12, "prompt_tokens": 400, "prefix_hit_tokens": 100},
            "globex": {"blocks_cached": 8, "prompt_tokens": 50, "prefix_hit_tokens": 0},
        },
    )
    _report(
        env,
        "eng-b",
        now=now,
        stats={"acme": {"blocks_active": 3, "prompt_tokens": 100, "prefix_hit_tokens": 100}},
    )


def test_cache_state_per_tenant_and_engine(make_env: Callable[..., ApiEnv], any_db: str) -> None:
    env = make_env(any_db)
    _fleet(env)
    states = env.call("auditor", "GET", "/v1/cache/tenants").json()
    assert [s["tenant_id"] for s in states] == ["acme", "globex"]
    acme = states[0]
    assert [e["engine_id"] for e in acme["engines"]] == ["eng-a", "eng-b"]
    assert acme["totals"]["blocks_cached"] == 12 and acme["totals"]["blocks_active"] == 3
    assert acme["totals"]["hit_rate"] == 200 / 500
    assert acme["totals"]["prefill_tokens_avoided"] == 200
    assert 29.0 <= acme["engines"][0]["oldest_cached_block_age_s"] < 300
    assert all(e["engine_live"] for e in acme["engines"])


def _numbers(value: object) -> list[object]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, int | float) and not isinstance(value, bool) else []


def test_a_tenant_sees_only_its_own_cache_state(env: ApiEnv) -> None:
    _fleet(env)
    own = env.call("globex", "GET", "/v1/cache/tenants")
    assert own.status_code == 200
    assert [s["tenant_id"] for s in own.json()] == ["globex"]
    assert "acme" not in own.text
    # acme's figures (400 prompt tokens) appear nowhere (not a substring check: timestamps vary)
    assert 400 not in _numbers(own.json())
    assert (
        env.call("globex", "GET", "/v1/cache/tenants", params={"tenant_id": "acme"}).status_code
        == 404
    )
    assert env.call("globex", "GET", "/v1/cache/engines").status_code == 403
    assert env.call("globex", "GET", "/metrics").status_code == 403


def test_a_tenant_without_engine_rows_gets_an_empty_state(env: ApiEnv) -> None:
    got = env.call("acme", "GET", "/v1/cache/tenants").json()
    assert got == [{"tenant_id": "acme", "engines": [], "totals": None}]
    # A tenant that does not exist is a 404, as on every other route, not a made-up row echoing
    # what was sent (found by a review; a pasted key fits the tenant id pattern).
    made_up = "kvg_adm_0123456789ab_secret"
    r = env.call("admin", "GET", "/v1/cache/tenants", params={"tenant_id": made_up})
    assert r.status_code == 404 and made_up not in r.text


def test_stale_engines_are_marked_and_left_out_of_metrics(env: ApiEnv) -> None:
    _report(env, "old", now=time.time() - 3600, stats={"acme": {"blocks_cached": 1}})
    engines = env.call("admin", "GET", "/v1/cache/engines").json()
    assert [(e["engine_id"], e["live"]) for e in engines] == [("old", False)]
    body = env.call("admin", "GET", "/metrics").text
    assert "kvguard_engines_known 1.0" in body and "kvguard_engines_live 0.0" in body
    assert 'engine="old"' not in body


def test_metrics_are_labelled_by_tag_never_by_tenant_id(env: ApiEnv) -> None:
    _fleet(env)
    env.call("admin", "POST", "/v1/tenants", json={"tenant_id": "initech"})  # one ledger append
    response = env.call("auditor", "GET", "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    body = response.text
    tag = env.services.deriver.tenant_tag("acme")
    assert f'kvguard_tenant_blocks_cached{{engine="eng-a",tenant_tag="{tag}"}} 12.0' in body
    assert 'kvguard_engine_blocks_free{engine="eng-b"} 40.0' in body
    assert 'kvguard_engine_cleanup_max_seconds{engine="eng-b"} 0.004' in body
    assert f'kvguard_tenant_prompt_tokens_total{{engine="eng-a",tenant_tag="{tag}"}} 400.0' in body
    assert "kvguard_ledger_entries 1.0" in body
    assert "kvguard_ledger_append_seconds_count 1.0" in body
    for tenant in ("acme", "globex", "initech"):
        assert tenant not in body
