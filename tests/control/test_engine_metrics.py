"""How an engine histogram travels in heartbeat totals and is read back (kvguard.control.engine_metrics)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.control.engine_metrics import (
    CACHE_AGE,
    CLEANUP,
    ENGINE_FIGURES,
    ENGINE_HISTOGRAMS,
    TENANT_FIGURES,
    BucketCounts,
    MetricType,
    read_histogram,
)


def test_a_value_on_a_bound_counts_in_that_bucket_and_totals_are_cumulative() -> None:
    counts = BucketCounts((0.1, 1.0))
    for value in (0.1, 0.5, 1.0, 7.0):
        counts.observe(value)
    assert counts.totals("x") == {
        "x.le=0.1": 1,
        "x.le=1.0": 3,
        "x.sum": pytest.approx(8.6),
        "x.count": 4,  # 7.0 is only in +Inf
    }


def test_non_finite_values_are_dropped_and_bad_bounds_refused() -> None:
    counts = BucketCounts((1.0,))
    counts.observe(float("nan"))
    counts.observe(float("inf"))
    assert (counts.count, counts.sum) == (0, 0.0)
    for bounds in ((), (1.0, 1.0), (2.0, 1.0)):
        with pytest.raises(ValueError, match="ascending"):
            BucketCounts(bounds)


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=50))
def test_what_the_engine_writes_the_api_reads_back(observations: list[float]) -> None:
    counts = BucketCounts(CLEANUP.buckets)
    for value in observations:
        counts.observe(value)
    reading = read_histogram(counts.totals(CLEANUP.series_key()), CLEANUP)
    assert [b for b, _ in reading.buckets] == list(CLEANUP.buckets)
    for bound, n in reading.buckets:
        assert n == sum(1 for v in observations if v <= bound)
    assert reading.count == len(observations)
    assert reading.sum == pytest.approx(sum(observations))


def test_a_series_not_written_yet_reads_as_zero_with_the_catalog_buckets() -> None:
    reading = read_histogram({"cleanup_seconds.count": 3}, CACHE_AGE, ("reused",))
    assert reading.buckets == tuple((b, 0.0) for b in CACHE_AGE.buckets)
    assert (reading.sum, reading.count) == (0.0, 0.0)


def test_the_reader_takes_the_engines_bounds_not_its_own() -> None:
    totals = {"cleanup_seconds.le=0.2": 1, "cleanup_seconds.le=2.0": 2, "cleanup_seconds.count": 3}
    totals |= {"cleanup_seconds.le=inf": 3, "cleanup_seconds.le=junk": 9}  # ignored
    reading = read_histogram(totals, CLEANUP)
    assert reading.buckets == ((0.2, 1.0), (2.0, 2.0)) and reading.count == 3


def test_catalog_names_follow_the_conventions() -> None:
    names = [f.name for f in (*ENGINE_FIGURES, *TENANT_FIGURES)]
    names += [h.key for h in ENGINE_HISTOGRAMS]
    assert len({f.name for f in ENGINE_FIGURES}) == len(ENGINE_FIGURES)
    assert len({f.key for f in ENGINE_FIGURES}) == len(ENGINE_FIGURES)
    for figure in (*ENGINE_FIGURES, *TENANT_FIGURES):
        assert figure.name.endswith("_total") == (figure.type is MetricType.COUNTER), figure
        assert figure.help and (not figure.unit or f"_{figure.unit}" in figure.name), figure
    for spec in ENGINE_HISTOGRAMS:
        assert spec.key.endswith(f"_{spec.unit}") and list(spec.buckets) == sorted(spec.buckets)
    assert all(name == name.lower() and " " not in name for name in names)
