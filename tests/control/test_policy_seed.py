"""One source of truth for policy (issue 10, item 5): a policy file seeds an empty store once, as a
ledger-recorded version; it never replaces what the store holds."""

from __future__ import annotations

import threading

from kvguard.audit.events import EventKind
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.control.policy_seed import SEED_AUTHOR, seed_from_file
from kvguard.policy import PolicySet, load_policy_file
from kvguard.policy.store import PolicyStore

POLICY = "version: 1\ntenants:\n  restricted-co:\n    classification: restricted\n"


def _ledger(url: str) -> Ledger:
    return Ledger.open(url, origin="kvguard.test/ledger", signing_key=SigningKey.generate("t"))


def _policy_changes(ledger: Ledger) -> list[int]:
    page = ledger.query(kinds=[EventKind.POLICY_CHANGE.value], limit=100)
    return [r.event.details["policy_version"] for r in page.records]


def test_the_file_becomes_version_1_once_and_is_recorded(db_url, tmp_path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    store, ledger = PolicyStore.open(db_url), _ledger(db_url)
    try:
        assert seed_from_file(store, ledger, path) == 1
        assert seed_from_file(store, ledger, path) == 1  # a restart seeds nothing more
        current = store.current()
        assert current is not None and current.change.author == SEED_AUTHOR
        assert current.policy.digest() == load_policy_file(path).digest()
        ledger.flush()
        assert _policy_changes(ledger) == [1]
    finally:
        ledger.close()
        store.engine.dispose()


def test_a_store_with_versions_wins_over_the_file(db_url, tmp_path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    store, ledger = PolicyStore.open(db_url), _ledger(db_url)
    try:
        store.put(PolicySet(epoch=7), author="admin", reason="set through the API")
        assert seed_from_file(store, ledger, path) == 1
        current = store.current()
        assert current is not None and current.policy.epoch == 7 and current.change.version == 1
        assert seed_from_file(store, ledger, None) == 1
    finally:
        ledger.close()
        store.engine.dispose()


def test_no_file_and_an_empty_store_leaves_it_empty(db_url) -> None:
    store, ledger = PolicyStore.open(db_url), _ledger(db_url)
    try:
        assert seed_from_file(store, ledger, None) is None
        assert store.current() is None
    finally:
        ledger.close()
        store.engine.dispose()


def test_engines_starting_together_seed_once(db_url, tmp_path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    results: list[int | None] = []
    barrier = threading.Barrier(6, timeout=60)
    opened = [(PolicyStore.open(db_url), _ledger(db_url)) for _ in range(6)]

    def start(store: PolicyStore, ledger: Ledger) -> None:
        barrier.wait()
        results.append(seed_from_file(store, ledger, path))

    threads = [threading.Thread(target=start, args=pair) for pair in opened]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for store, ledger in opened:
        ledger.close()
        store.engine.dispose()
    assert results == [1] * 6
    store = PolicyStore.open(db_url)
    assert [c.version for c in store.history()] == [1]
    store.engine.dispose()
