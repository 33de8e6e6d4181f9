"""The versioned policy store on SQLite and PostgreSQL: append-only, gapless, hooked, verified."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvguard.errors import PolicyStoreError, PolicyValidationError
from kvguard.policy import PolicyChange, PolicySet, PolicyStore
from kvguard.policy.store import _LimitIndex
from tests.dbs import fresh_pg_database
from tests.policy.conftest import policy_set


class FakeClock:
    def __init__(self, start: float = 1_764_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.5
        return self.now


def _sqlite(tmp_path: Path, clock: FakeClock) -> Iterator[PolicyStore]:
    store = PolicyStore.open(f"sqlite:///{tmp_path / 'policy.db'}", clock=clock)
    yield store
    store.engine.dispose()


def _postgres(clock: FakeClock) -> Iterator[PolicyStore]:
    with fresh_pg_database("kvg_policy") as url:
        store = PolicyStore.open(url, clock=clock)
        try:
            yield store
        finally:
            store.engine.dispose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pg_store(clock: FakeClock) -> Iterator[PolicyStore]:
    yield from _postgres(clock)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[PolicyStore]:
    if request.param == "sqlite":
        yield from _sqlite(tmp_path, clock)
    else:
        yield from _postgres(clock)


def _v(n: int) -> PolicySet:
    return policy_set({"acme": {"retention": {"ttl_s": 60 * n, "idle_s": 60}}}, epoch=n)


def test_empty_store(store: PolicyStore) -> None:
    assert store.current() is None
    assert store.history() == []
    with pytest.raises(PolicyStoreError, match="version 1 does not exist"):
        store.get(1)


def test_every_put_is_a_new_gapless_version(store: PolicyStore, clock: FakeClock) -> None:
    versions = [store.put(_v(n), author="alice", reason=f"change {n}") for n in (1, 2, 3)]
    versions.append(store.put(_v(3), author="bob", reason="same content again"))
    assert versions == [1, 2, 3, 4]
    current = store.current()
    assert current is not None and current.change.version == 4 and current.policy == _v(3)
    assert store.get(1).policy == _v(1)
    assert store.get(2).change.reason == "change 2"
    history = store.history()
    assert [c.version for c in history] == [1, 2, 3, 4]
    assert [c.author for c in history] == ["alice", "alice", "alice", "bob"]
    assert history[2].digest == history[3].digest == _v(3).digest()
    assert [c.at for c in history] == sorted(c.at for c in history)
    assert history[-1].at == clock.now  # the injected clock, not the wall clock


def test_store_keeps_the_canonical_json(store: PolicyStore) -> None:
    store.put(_v(1), author="alice", reason="r")
    with store.engine.connect() as conn:
        document = conn.execute(sa.text("SELECT document FROM policy_versions")).scalar_one()
    assert document == _v(1).canonical_json()


def test_subscribers_receive_each_change_before_it_commits(store: PolicyStore) -> None:
    seen: list[PolicyChange] = []

    def record(change: PolicyChange) -> None:
        assert store_versions_visible_elsewhere(store) < change.version  # not committed yet
        seen.append(change)

    unsubscribe = store.subscribe(record)
    version = store.put(_v(1), author="alice", reason="initial")
    assert seen == store.history()
    assert seen[0] == PolicyChange(
        version=version, author="alice", reason="initial", digest=_v(1).digest(), at=seen[0].at
    )
    unsubscribe()
    store.put(_v(2), author="alice", reason="after unsubscribe")
    assert len(seen) == 1


def store_versions_visible_elsewhere(store: PolicyStore) -> int:
    # Another connection: on SQLite, WAL lets it read while the writer holds the write lock.
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM policy_versions")).scalar_one())


def test_a_failing_subscriber_rolls_the_change_back(store: PolicyStore) -> None:
    store.put(_v(1), author="alice", reason="initial")

    def ledger_down(_change: PolicyChange) -> None:
        raise ConnectionError("ledger unavailable")

    unsubscribe = store.subscribe(ledger_down)
    with pytest.raises(PolicyStoreError, match="version 2 not stored") as info:
        store.put(_v(2), author="alice", reason="unrecorded")
    assert isinstance(info.value.__cause__, ConnectionError)
    assert [c.version for c in store.history()] == [1]
    unsubscribe()
    assert store.put(_v(2), author="alice", reason="recorded") == 2  # still gapless


@pytest.mark.parametrize(
    ("author", "reason", "expected"),
    [
        ("", "r", "author must not be empty"),
        ("a", "  ", "reason must not be empty"),
        ("a" * 257, "r", "author is longer"),
        ("a", "r" * 2001, "reason is longer"),
    ],
)
def test_put_needs_author_and_reason(
    store: PolicyStore, author: str, reason: str, expected: str
) -> None:
    with pytest.raises(PolicyStoreError, match=expected):
        store.put(_v(1), author=author, reason=reason)
    assert store.history() == []


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE policy_versions SET reason = 'rewritten'",
        "DELETE FROM policy_versions",
        "UPDATE policy_head SET version = 0",
        "UPDATE policy_head SET version = version + 2",
        "DELETE FROM policy_head",
    ],
)
def test_the_database_refuses_to_rewrite_history(store: PolicyStore, statement: str) -> None:
    store.put(_v(1), author="alice", reason="r")
    with pytest.raises(sa.exc.DBAPIError, match="kvguard policy"), store.engine.begin() as conn:
        conn.execute(sa.text(statement))
    assert [(c.version, c.reason) for c in store.history()] == [(1, "r")]


@pytest.mark.postgres
@pytest.mark.parametrize("table", ["policy_versions", "policy_head"])
def test_postgres_refuses_truncate(pg_store: PolicyStore, table: str) -> None:
    pg_store.put(_v(1), author="alice", reason="r")
    with pytest.raises(sa.exc.DBAPIError, match="kvguard policy"), pg_store.engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {table}"))
    assert len(pg_store.history()) == 1


def test_put_refuses_an_unvalidated_policy(store: PolicyStore) -> None:
    # model_construct() skips validation; the store must not accept what it could not read back.
    sneaky = PolicySet.model_construct(epoch=-1)
    with pytest.raises(PolicyValidationError, match="epoch"):
        store.put(sneaky, author="alice", reason="r")
    assert store.history() == []


def test_a_tampered_row_is_refused(store: PolicyStore) -> None:
    # An attacker who owns the database can drop the guard; the digest check still catches the edit.
    store.put(_v(1), author="alice", reason="r")
    weaker = _v(1).canonical_json().replace('"ttl_s":60', '"ttl_s":86400')
    with store.engine.begin() as conn:
        if store.engine.dialect.name == "sqlite":
            conn.execute(sa.text("DROP TRIGGER policy_versions_no_update"))
        else:
            conn.execute(sa.text("ALTER TABLE policy_versions DISABLE TRIGGER ALL"))
        conn.execute(sa.text("UPDATE policy_versions SET document = :d"), {"d": weaker})
    with pytest.raises(PolicyStoreError, match="does not match its digest"):
        store.current()
    with pytest.raises(PolicyStoreError, match="does not match its digest"):
        store.get(1)


def test_a_written_version_is_checked_but_not_parsed_again(
    store: PolicyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer validated the document it stored; its first read checks the row's digest (the
    # test above) and reuses that parse, and a second store (another process) parses it itself.
    import kvguard.policy.store as store_module  # noqa: PLC0415

    parses: list[str] = []
    real = store_module.parse_policy

    def counting(text: str, source: str = "<string>", **kwargs: object) -> PolicySet:
        parses.append(source)
        return real(text, source, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store_module, "parse_policy", counting)
    store.put(_v(2), author="alice", reason="r")
    assert parses == ["policy to store"]
    current = store.current()
    assert current is not None and current.policy == _v(2) and current.change.author == "alice"
    assert parses == ["policy to store"]
    other = PolicyStore(store.engine)
    other_current = other.current()
    assert other_current is not None and other_current.policy == _v(2)
    assert parses == ["policy to store", "policy store version 1"]


def test_concurrent_writers_get_distinct_gapless_versions(store: PolicyStore) -> None:
    results: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def writer(who: str) -> None:
        try:
            for n in range(1, 6):
                version = store.put(_v(n), author=who, reason="race")
                with lock:
                    results.append(version)
        except BaseException as exc:  # surfaced below, with the thread's failure
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results) == list(range(1, 16))
    assert [c.version for c in store.history()] == list(range(1, 16))


def test_reopening_keeps_history_and_schema_creation_is_idempotent(
    tmp_path: Path, clock: FakeClock
) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    first = PolicyStore.open(url, clock=clock)
    first.put(_v(1), author="alice", reason="r")
    first.create_schema()
    second = PolicyStore.open(url, clock=clock)
    assert second.put(_v(2), author="bob", reason="r") == 2
    assert [c.author for c in second.history()] == ["alice", "bob"]
    for s in (first, second):
        s.engine.dispose()


def test_put_without_schema_fails_clearly(tmp_path: Path, clock: FakeClock) -> None:
    store = PolicyStore(sa.create_engine(f"sqlite:///{tmp_path / 'none.db'}"), clock=clock)
    with pytest.raises(PolicyStoreError, match="cannot store the policy"):
        store.put(_v(1), author="alice", reason="r")
    store.engine.dispose()


def test_the_limit_index_answers_only_for_ranges_it_covers() -> None:
    """`_LimitIndex`: an answer only for (after, upto] inside what it learnt contiguously; a later
    version learnt first is never replaced by an earlier one learnt late; a gap starts it again;
    a store holding fewer versions than it knew empties it."""
    index = _LimitIndex()
    assert index.find("acme", 0, 5) == (False, None)  # nothing learnt yet
    index.add(2, 10, [("acme", 5, "d5"), ("beta", 9, "d9")], ("d10", 0.0))
    assert index.find("acme", 2, 10) == (True, (5, "d5"))
    assert index.find("acme", 5, 10) == (True, None)  # acme's is not after 5
    assert index.find("gamma", 2, 10) == (True, None)
    assert index.find("acme", 1, 10) == (False, None)  # before what it learnt
    assert index.find("acme", 2, 11) == (False, None)  # after it
    assert index.find("beta", 2, 8) == (False, None)  # a later one is known, not the one up to 8
    index.add(
        4, 8, [("acme", 4, "d4")], ("d8", 0.0)
    )  # a read that started before the last one was learnt
    assert index.find("acme", 2, 10) == (True, (5, "d5"))
    index.add(10, 12, [("acme", 12, "d12")], ("d12", 0.0))
    assert (index.floor, index.upto, index.anchor) == (2, 12, ("d12", 0.0))
    assert index.find("acme", 2, 12) == (True, (12, "d12"))
    index.add(20, 21, [], ("d21", 0.0))  # versions 13-20 unknown: start again from 20
    assert (index.floor, index.upto, index.latest) == (20, 21, {})
    assert index.find("acme", 2, 21) == (False, None)
    index.add(21, 7, [], ("d7", 0.0))  # the store now ends at 7
    assert index.find("acme", 7, 7) == (True, None)
    assert index.find("acme", 6, 7) == (False, None)


def test_a_stored_version_an_older_release_accepted_stays_readable(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Tenant entries must now be keyed by possible tenant ids; a version an older release stored
    with another key ("acme " for acme) is still read, as it was accepted (else a deployment's
    current policy would be unreadable after an upgrade, and every engine would refuse work),
    while a new write on top of it must drop that entry (the error names its position)."""
    import hashlib  # noqa: PLC0415

    url = f"sqlite:///{tmp_path / 'policy.db'}"
    store = PolicyStore.open(url, clock=clock)
    store.put(_v(1), author="alice", reason="r")
    old = _v(1).canonical_json().replace('"acme"', '"acme "')
    digest = "sha256:" + hashlib.sha256(old.encode()).hexdigest()
    with store.engine.begin() as conn:  # as the older release stored it
        conn.execute(sa.text("DROP TRIGGER policy_versions_no_update"))
        conn.execute(sa.text("UPDATE policy_versions SET document = :d, digest = :g"),
                     {"d": old, "g": digest})  # fmt: skip
    store.engine.dispose()
    reopened = PolicyStore.open(url, clock=clock)
    try:
        current = reopened.current()
        assert current is not None and list(current.policy.tenants) == ["acme "]
        with pytest.raises(PolicyValidationError, match="entry 1 is not a tenant id"):
            reopened.put(current.policy, author="alice", reason="unchanged")
    finally:
        reopened.engine.dispose()
