"""Engine statistics and heartbeats: a failing database never stops the engine, nothing is lost."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
import structlog

from kvguard.control.engines import EngineRegistry
from kvguard.engine_adapter.vllm.reporting import EngineReporter
from tests.engine_adapter.conftest import DERIVER, scope_for


def _reporter(url: str) -> EngineReporter:
    reporter = EngineReporter(
        EngineRegistry.open(url), engine_id="e1", tenant_tag=DERIVER.tenant_tag, clock=lambda: 0.0
    )
    reporter.register(model="tiny", block_size=16, num_blocks=16)
    return reporter


def test_failed_heartbeat_is_logged_without_detail_and_retried(
    sqlite_url, make_custody, monkeypatch
) -> None:
    reporter = _reporter(sqlite_url)
    custody = make_custody()
    reporter.new_tag("st_a", "a")
    reporter.prompt("a", 40)

    def broken(*_args, **_kwargs):
        raise sa.exc.OperationalError("UPDATE engines", {}, Exception(f"cannot reach {sqlite_url}"))

    with monkeypatch.context() as patch, structlog.testing.capture_logs() as logs:
        patch.setattr(reporter.registry, "heartbeat", broken)
        assert reporter.heartbeat(1.0, custody.summary(), {}) is False
    assert [e["error"] for e in logs] == ["OperationalError"]
    assert sqlite_url not in repr(logs)  # the error text (it may carry the URL) is not logged
    assert not reporter.due(2.0) and reporter.due(3.0)  # retried at the next heartbeat
    assert reporter.heartbeat(3.0, custody.summary(), {}) is True
    assert reporter.registry.tags_for_tenant("a") == ["st_a"]  # the buffered tag was kept
    (row,) = reporter.registry.tenant_stats("a")
    assert row.prompt_tokens == 40 and row.tenant_tag == DERIVER.tenant_tag("a")
    reporter.close(4.0, custody.summary(), {})


def test_zeroized_blocks_bytes_and_cleanup_latency_per_owner(sqlite_url, make_custody) -> None:
    reporter = _reporter(sqlite_url)
    c = make_custody()
    c.begin("r1", scope_for("a"), use_cache=False)
    c.allocate("r1", [0, 1], 0.0)
    c.finish("r1", 2.0)  # both quarantined at t=2
    details = {
        "bytes_cleared": 8192,
        "block_count": 2,
        "wall_time_us": 30.0,
        "device_time_us": None,
    }
    reporter.zeroized(c, (0, 1), details, handover=False, now=2.5)
    c.zeroized([0, 1], 2.5, details)
    c.begin("rb", scope_for("b"), use_cache=True)  # b caches block 5 ...
    c.allocate("rb", [5], 2.6)
    c.mark_hashed([5])
    c.finish("rb", 2.7)
    c.begin("rc", scope_for("c"), use_cache=True)  # ... and the engine hands it to c
    assert c.allocate("rc", [5], 2.8) == (5,)
    reporter.zeroized(c, (5,), {"bytes_cleared": 4096, "block_count": 1}, handover=True, now=3.0)
    assert reporter.blocks_zeroized == {"a": 2, "b": 1}
    assert reporter.bytes_zeroized == {"a": 8192, "b": 4096}
    cleanup, wall = reporter.histograms["cleanup_seconds"], reporter.histograms["zeroize_seconds"]
    assert (cleanup.count, cleanup.sum, reporter.cleanup_max_s) == (2, 1.0, 0.5)  # release only
    assert (wall.count, wall.sum) == (1, pytest.approx(30e-6))  # microseconds in, seconds out
    assert reporter.histograms["zeroize_device_seconds"].count == 0  # None: no CUDA events
    assert reporter.heartbeat(4.0, c.summary(), {"ledger_submitted": 3})
    (engine,) = reporter.registry.engines()
    assert engine.totals["bytes_zeroized"] == 12288 and engine.totals["ledger_submitted"] == 3
    assert engine.totals["blocks_free"] == 15  # block 5 is still active for tenant c
    assert engine.totals["zeroize_seconds.count"] == 1
    assert engine.totals["zeroize_seconds.le=2.5e-05"] == 0
    assert engine.totals["zeroize_seconds.le=5e-05"] == 1
    assert engine.totals["cleanup_seconds.le=0.25"] == 0
    assert engine.totals["cleanup_seconds.le=0.5"] == 2
    assert engine.totals["cleanup_max_seconds"] == 0.5
    # Block 5's cached life ended when the engine gave it to c: its age went into the histogram.
    reporter.cache_ages(c.take_cache_ages())
    evicted = reporter.histograms["cache_block_age_seconds.evicted"]
    assert (evicted.count, evicted.sum) == (1, pytest.approx(0.2))
    reporter.close(5.0, c.summary(), {})
    (engine,) = reporter.registry.engines()
    assert engine.stopped_at == 5.0


def test_every_histogram_series_is_in_the_first_heartbeat(sqlite_url, make_custody) -> None:
    """No traffic yet: the totals already hold every histogram series, all zero (issue 13)."""
    reporter = _reporter(sqlite_url)
    assert reporter.heartbeat(1.0, make_custody().summary(), {})
    (engine,) = reporter.registry.engines()
    for series in (
        "cleanup_seconds",
        "zeroize_seconds",
        "zeroize_device_seconds",
        *(f"cache_block_age_seconds.{r}" for r in ("reused", "evicted", "expired", "purged")),
    ):
        assert engine.totals[f"{series}.count"] == 0 and engine.totals[f"{series}.sum"] == 0
        assert {v for k, v in engine.totals.items() if k.startswith(f"{series}.le=")} == {0}
    assert engine.totals["evictions"] == 0 and engine.totals["bytes_zeroized"] == 0


def test_a_non_finite_zeroize_time_never_blocks_heartbeats(sqlite_url, make_custody) -> None:
    reporter = _reporter(sqlite_url)
    c = make_custody()
    c.begin("r1", scope_for("a"), use_cache=False)
    c.allocate("r1", [0], 0.0)
    c.finish("r1", 1.0)
    details = {"bytes_cleared": 4096, "block_count": 1, "wall_time_us": float("nan")}
    reporter.zeroized(c, (0,), details, handover=False, now=1.5)
    assert reporter.histograms["zeroize_seconds"].count == 0  # dropped, not stored as NaN
    assert reporter.heartbeat(2.0, c.summary(), {})  # the totals stay finite


def test_a_deferred_heartbeat_is_taken_now_written_later_and_never_after_the_last(
    sqlite_url, make_custody
) -> None:
    """The scheduler thread takes the figures; the engine link's thread writes them. A deferred
    write still queued when the engine stops is dropped: the last heartbeat stays the last."""
    reporter = _reporter(sqlite_url)
    custody = make_custody()
    queued: list = []
    reporter.prompt("a", 10)
    reporter.new_tag("st_a", "a")
    reporter.heartbeat_soon(1.0, custody.summary(), {}, queued.append)
    reporter.prompt("a", 5)  # after the figures were taken: not in this heartbeat
    assert reporter.heartbeats == 0 and not reporter.due(2.0)
    assert queued[0]() is True  # the link's thread
    (row,) = reporter.registry.tenant_stats("a")
    assert row.prompt_tokens == 10 and reporter.registry.tags_for_tenant("a") == ["st_a"]
    reporter.heartbeat_soon(3.0, custody.summary(), {}, queued.append)
    reporter.close(4.0, custody.summary(), {})
    assert queued[1]() is False  # queued before the stop, run after it: not written
    (row,) = reporter.registry.tenant_stats("a")
    assert row.prompt_tokens == 15 and reporter.heartbeats == 2


def test_a_deferred_heartbeat_never_replaces_a_newer_one(sqlite_url, make_custody) -> None:
    """Figures taken at a step and queued for the link's thread, then a heartbeat written at once
    (`report_now`) with newer figures: the queued one, written last, must not put the older
    figures back. Its new scope tags still reach the registry with the next heartbeat."""
    reporter = _reporter(sqlite_url)
    custody = make_custody()
    queued: list = []
    reporter.new_tag("st_a", "a")
    reporter.heartbeat_soon(1.0, custody.summary(), {"requests": 0}, queued.append)
    reporter.prompt("a", 7)
    assert reporter.heartbeat(2.0, custody.summary(), {"requests": 2})
    assert queued[0]() is True  # nothing to write: a newer heartbeat is there
    (engine,) = reporter.registry.engines()
    assert engine.totals["requests"] == 2
    (row,) = reporter.registry.tenant_stats("a")
    assert row.prompt_tokens == 7
    assert reporter.heartbeat(3.0, custody.summary(), {"requests": 2})
    assert reporter.registry.tags_for_tenant("a") == ["st_a"]


def test_scope_tags_of_a_deferred_heartbeat_dropped_at_stop_reach_the_last_one(
    sqlite_url, make_custody
) -> None:
    """A tenant's export finds its entries by the scope tags its engines registered: a tag taken
    into a deferred heartbeat that the stop then drops must go with the last heartbeat."""
    reporter = _reporter(sqlite_url)
    custody = make_custody()
    queued: list = []
    reporter.new_tag("st_a", "a")
    reporter.heartbeat_soon(1.0, custody.summary(), {}, queued.append)
    reporter.new_tag("st_b", "b")
    reporter.close(2.0, custody.summary(), {})
    assert queued[0]() is False  # after the last heartbeat: not written
    assert reporter.registry.tags_for_tenant("a") == ["st_a"]
    assert reporter.registry.tags_for_tenant("b") == ["st_b"]


def test_a_deferred_heartbeat_that_fails_keeps_its_tags_for_the_next(
    sqlite_url, make_custody, monkeypatch
) -> None:
    reporter = _reporter(sqlite_url)
    custody = make_custody()
    reporter.new_tag("st_a", "a")
    queued: list = []
    reporter.heartbeat_soon(1.0, custody.summary(), {}, queued.append)

    def broken(*_args, **_kwargs):
        raise sa.exc.OperationalError("UPDATE engines", {}, Exception("down"))

    with monkeypatch.context() as patch:
        patch.setattr(reporter.registry, "heartbeat", broken)
        assert queued[0]() is False
    reporter.new_tag("st_b", "b")
    assert reporter.heartbeat(3.0, custody.summary(), {}) is True
    assert reporter.registry.tags_for_tenant("a") == ["st_a"]
    assert reporter.registry.tags_for_tenant("b") == ["st_b"]
    reporter.close(4.0, custody.summary(), {})
