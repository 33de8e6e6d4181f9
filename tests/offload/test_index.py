"""The scheduler's tier index (issue 15): budgets, tenant caps, contiguous lookups, expiry."""

from __future__ import annotations

import pytest

from kvguard.offload.index import IndexEntry, TierIndex, TierKey


def entry(domain: bytes, position: int, *, tenant: str = "a", size: int = 100, at: float = 0.0):
    key = TierKey(domain, f"h{position}".encode(), position)
    return IndexEntry(key, tenant, f"st_{tenant}", size, at)


def hashes(n: int) -> list[bytes]:
    return [f"h{i}".encode() for i in range(n)]


def test_budget_evicts_the_least_recently_used_first() -> None:
    index = TierIndex(300)
    for p in range(3):
        assert index.add(entry(b"d", p), tenant_cap=None) == []
    index.touch([TierKey(b"d", b"h0", 0)])
    gone = index.add(entry(b"d", 3), tenant_cap=None)
    assert [g.key.position for g in gone] == [1]  # 0 was used since; 1 is the oldest
    assert index.used == 300 and len(index) == 3


def test_a_tenant_cap_evicts_only_that_tenants_entries() -> None:
    index = TierIndex(10_000)
    index.add(entry(b"x", 0, tenant="other"), tenant_cap=None)
    index.add(entry(b"d", 0), tenant_cap=200)
    index.add(entry(b"d", 1), tenant_cap=200)
    gone = index.add(entry(b"d", 2), tenant_cap=200)
    assert [(g.tenant, g.key.position) for g in gone] == [("a", 0)]
    assert index.tenant_bytes("a") == 200 and index.tenant_bytes("other") == 100


def test_an_entry_larger_than_its_limit_is_refused() -> None:
    index = TierIndex(1000)
    big = entry(b"d", 0, size=300)
    assert index.add(big, tenant_cap=200) == [big]
    assert len(index) == 0 and index.used == 0


def test_replacing_an_entry_does_not_ask_the_worker_to_drop_it() -> None:
    # The worker's store replaced the ciphertext at that key already; a drop would delete the new one.
    index = TierIndex(1000)
    index.add(entry(b"d", 0), tenant_cap=None)
    assert index.add(entry(b"d", 0, size=120), tenant_cap=None) == []
    assert index.used == 120 and len(index) == 1


def test_run_is_contiguous_within_one_domain() -> None:
    index = TierIndex(10_000)
    for p in (1, 2, 4):
        index.add(entry(b"d", p), tenant_cap=None)
    index.add(entry(b"other", 0), tenant_cap=None)
    assert [k.position for k in index.run(b"d", hashes(6), 1, 6)] == [1, 2]  # 3 is missing
    assert index.run(b"d", hashes(6), 0, 6) == []  # position 0 is not held
    assert index.run(b"e", hashes(6), 1, 6) == []  # another domain finds nothing
    assert [k.position for k in index.run(b"d", hashes(6), 1, 2)] == [1]  # stop is exclusive


def test_expiry_and_domain_removal() -> None:
    index = TierIndex(10_000)
    index.add(entry(b"d", 0, at=0.0), tenant_cap=None)
    index.add(entry(b"d", 1, at=50.0), tenant_cap=None)
    index.add(entry(b"e", 0, tenant="b", at=0.0), tenant_cap=None)
    gone = index.expire(
        60.0, lambda e, now: now - e.stored_at >= (30.0 if e.tenant == "a" else 100.0)
    )
    assert [g.key for g in gone] == [TierKey(b"d", b"h0", 0)]
    assert index.domain_usage(b"d") == (1, 100)
    assert [g.key.position for g in index.remove_domain(b"d")] == [1]
    assert not index.has_domain(b"d") and index.has_domain(b"e")
    assert index.used == 100


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        TierIndex(0)
