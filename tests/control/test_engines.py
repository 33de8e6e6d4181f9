"""The engine registry: engine rows, per-tenant cache statistics and the scope-tag index."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from kvguard.control.engines import EngineRegistry, TenantCacheStats


def _stats(engine_id: str, tenant: str, **fields: int | float | None) -> TenantCacheStats:
    return TenantCacheStats(
        engine_id=engine_id, tenant_id=tenant, tenant_tag=f"tt_{tenant}", **fields
    )  # type: ignore[arg-type]


@pytest.fixture
def registry(db_url: str):
    reg = EngineRegistry.open(db_url)
    yield reg
    reg.engine.dispose()


def test_heartbeat_round_trip_replaces_tenant_rows_and_keeps_tags(registry) -> None:
    registry.register("e1", model="tiny", block_size=32, num_blocks=64, now=100.0)
    (info,) = registry.engines()
    assert (info.model, info.block_size, info.num_blocks) == ("tiny", 32, 64)
    assert info.stats_at is None and info.stopped_at is None and info.totals == {}
    registry.heartbeat(
        "e1",
        now=102.0,
        totals={"requests": 7, "cleanup_seconds.sum": 0.25},
        tenants=[
            _stats("e1", "a", blocks_cached=3, prefix_hit_tokens=64, oldest_cached_at=101.5),
            _stats("e1", "b", blocks_active=1, bytes_zeroized=4096, blocks_zeroized=2),
        ],
        new_tags=[("st_a1", "a"), ("st_b1", "b")],
    )
    (info,) = registry.engines()
    assert info.totals == {"requests": 7, "cleanup_seconds.sum": 0.25}
    assert info.last_seen == info.stats_at == 102.0
    (a,) = registry.tenant_stats("a")
    assert (a.blocks_cached, a.prefix_hit_tokens, a.oldest_cached_at) == (3, 64, 101.5)
    assert a.tenant_tag == "tt_a" and a.updated_at == 102.0 and a.blocks_active == 0
    (b,) = registry.tenant_stats("b")
    assert (b.blocks_active, b.blocks_zeroized, b.bytes_zeroized) == (1, 2, 4096)
    assert b.oldest_cached_at is None
    # The next heartbeat is the whole picture: b holds nothing any more and is gone.
    registry.heartbeat(
        "e1",
        now=104.0,
        totals={"requests": 9},
        tenants=[_stats("e1", "a", blocks_cached=1)],
        new_tags=[("st_a1", "a"), ("st_a2", "a")],
    )
    assert [s.tenant_id for s in registry.tenant_stats()] == ["a"]
    assert registry.tenant_stats("a")[0].blocks_cached == 1
    assert registry.tags_for_tenant("a") == ["st_a1", "st_a2"]
    assert registry.tags_for_tenant("b") == ["st_b1"]
    assert registry.tenant_for_tag("st_b1") == "b"
    assert registry.tenant_for_tag("st_nobody") is None


def test_liveness_touch_and_stop(registry) -> None:
    registry.register("old", model="m", block_size=16, num_blocks=8, now=0.0)
    registry.register("idle", model="m", block_size=16, num_blocks=8, now=0.0)
    registry.register("gone", model="m", block_size=16, num_blocks=8, now=0.0)
    registry.heartbeat("idle", now=1.0, totals={}, tenants=[])
    registry.touch("idle", 50.0)  # keep-alive: seen, figures unchanged
    registry.touch("gone", 50.0)
    registry.stop("gone", 51.0)
    registry.touch("gone", 52.0)  # a stopped engine stays stopped
    assert [e.engine_id for e in registry.live_engines(55.0, max_age_s=10.0)] == ["idle"]
    by_id = {e.engine_id: e for e in registry.engines()}
    assert by_id["idle"].last_seen == 50.0 and by_id["idle"].stats_at == 1.0
    assert by_id["gone"].stopped_at == 51.0 and by_id["gone"].last_seen == 51.0
    assert registry.tenant_stats("x", engine_ids=["idle"]) == []


def test_heartbeat_refuses_non_counts_and_unknown_engines_without_writing(registry) -> None:
    registry.register("e1", model="m", block_size=16, num_blocks=8, now=0.0)
    with pytest.raises(ValueError, match="finite number"):
        registry.heartbeat("e1", now=1.0, totals={"tenant": "acme"}, tenants=[])  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="finite number"):
        registry.heartbeat("e1", now=1.0, totals={"x": float("nan")}, tenants=[])
    with pytest.raises(ValueError, match="another engine"):
        registry.heartbeat("e1", now=1.0, totals={}, tenants=[_stats("e2", "a")])
    with pytest.raises(LookupError):
        registry.heartbeat(
            "nobody", now=1.0, totals={}, tenants=[_stats("nobody", "a")], new_tags=[("st_x", "a")]
        )
    assert registry.tenant_stats() == [] and registry.tags_for_tenant("a") == []
    assert registry.engines()[0].stats_at is None


def test_two_engines_announce_the_same_tags_concurrently(db_url) -> None:
    """Each engine has its own connection pool; both insert the same tags at the same moment."""
    registries = [EngineRegistry.open(db_url) for _ in range(2)]
    tags = [(f"st_shared{i:03d}", "acme") for i in range(40)]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def engine(n: int) -> None:
        reg = registries[n]
        try:
            reg.register(f"e{n}", model="m", block_size=16, num_blocks=8, now=0.0)
            start.wait()
            for round_ in range(10):
                batch = tags[round_ * 4 : round_ * 4 + 8] + tags[-3:]  # overlaps every round
                reg.heartbeat(
                    f"e{n}",
                    now=float(round_),
                    totals={"round": round_},
                    tenants=[_stats(f"e{n}", "acme", blocks_cached=round_)],
                    new_tags=batch,
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    reader = registries[0]
    assert reader.tags_for_tenant("acme") == [t for t, _ in tags]
    assert {(s.engine_id, s.blocks_cached) for s in reader.tenant_stats("acme")} == {
        ("e0", 9),
        ("e1", 9),
    }
    for reg in registries:
        reg.engine.dispose()


def test_create_all_is_idempotent(db_url) -> None:
    first = EngineRegistry.open(db_url)
    first.register("e1", model="m", block_size=16, num_blocks=8, now=0.0)
    second = EngineRegistry.open(db_url)
    assert [e.engine_id for e in second.engines()] == ["e1"]
    first.engine.dispose()
    second.engine.dispose()


def test_a_heartbeat_behind_another_sqlite_writer_fails_fast(sqlite_url: str) -> None:
    """The scheduler thread sends heartbeats: behind another process's write lock it gives up after
    about two seconds (and retries at the next heartbeat), not the 30 s other writers wait."""
    registry = EngineRegistry.open(sqlite_url)
    registry.register("e1", model="tiny", block_size=32, num_blocks=64, now=1.0)
    other = sa.create_engine(sqlite_url, connect_args={"isolation_level": None})
    with other.connect() as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # another writer holds the lock
        start = time.monotonic()
        with pytest.raises(sa.exc.OperationalError):
            registry.heartbeat("e1", now=2.0, totals={}, tenants=[])
        waited = time.monotonic() - start
        conn.exec_driver_sql("ROLLBACK")
    assert 1.0 < waited < 6.0
    registry.heartbeat("e1", now=3.0, totals={}, tenants=[])  # and the connection is fine after
    with registry.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        assert raw.execute("PRAGMA busy_timeout").fetchone()[0] == 30_000  # restored
    other.dispose()
    registry.engine.dispose()


def test_registering_a_running_engine_again_keeps_its_start(registry) -> None:
    """A registration retried after an outage hid its commit (found by a review): the engine was
    live from the first one, so a purge job dated in between still waits for it. A stopped
    engine registering again starts anew."""
    from kvguard.control.engines import expected_engines  # noqa: PLC0415

    registry.register("e1", model="m", block_size=16, num_blocks=8, now=100.0)
    registry.register("e1", model="m", block_size=16, num_blocks=8, now=103.0)  # the retry
    (info,) = registry.engines()
    assert info.started_at == 100.0 and info.last_seen == 103.0
    assert expected_engines(registry.engines(), 101.0, 10.0) == {"e1"}
    registry.stop("e1", now=110.0)
    registry.register("e1", model="m", block_size=16, num_blocks=8, now=120.0)
    (info,) = registry.engines()
    assert info.started_at == 120.0 and info.stopped_at is None
    assert expected_engines(registry.engines(), 115.0, 10.0) == set()
