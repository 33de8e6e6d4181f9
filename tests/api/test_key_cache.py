"""The revocation-coherent key cache (`kvguard.control.key_cache`): a request of a cached key reads
no key row, and a revoked key is refused from the very next request in every API process, also
when a process's listener connection is cut. Two API instances on one PostgreSQL database stand for
two server processes: each has its own pool, listener connection and cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from kvguard.api.app import create_app
from kvguard.api.auth import ApiKeys, Principal, Role
from kvguard.api.services import Services
from kvguard.audit.db import create_engine
from kvguard.control.key_cache import LEASE_S, CachedKey, KeyCache
from kvguard.control.outbox import operator_event, record_operator_change
from tests.api.conftest import ApiEnv, make_config
from tests.dbs import PG_URL

MakeEnv = Callable[..., ApiEnv]


class Instance:
    """A second API process on the same database: its own services, cache and client."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.client = TestClient(create_app(services))

    def get(self, api_key: str, path: str = "/v1/tenants") -> int:
        headers = {"Authorization": f"Bearer {api_key}"}
        return int(self.client.get(path, headers=headers).status_code)


@pytest.fixture
def second(pg_db: str, tmp_path: Path) -> Iterator[Instance]:
    directory = tmp_path / "second"
    directory.mkdir()
    config, _key = make_config(directory, pg_db)
    services = Services.open(config)
    instance = Instance(services)
    yield instance
    instance.client.close()
    services.close()


def _listening(*services: Services) -> None:
    for s in services:
        assert s.key_cache is not None and s.key_cache.wait_listening(10)


def _key_id(api_key: str) -> str:
    return api_key.split("_")[2]


def _count_key_reads(services: Services, monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    calls: list[str | None] = []
    real = services.keys.authenticate

    def counted(api_key: str | None) -> Principal | None:
        calls.append(api_key)
        return real(api_key)

    monkeypatch.setattr(services.keys, "authenticate", counted)
    return calls


@pytest.mark.postgres
def test_a_cached_key_reads_no_key_row(
    make_env: MakeEnv, pg_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_env(pg_db)
    _listening(env.services)
    reads = _count_key_reads(env.services, monkeypatch)
    for _ in range(3):
        assert env.call("admin", "GET", "/v1/tenants").status_code == 200
    assert len(reads) == 1  # the first request read the row; the others took it from the cache


@pytest.mark.postgres
def test_a_wrong_secret_for_a_cached_key_id_is_checked_against_the_database(
    make_env: MakeEnv, pg_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constant work: a failure always reads the row, as for an unknown key id, so timing does not
    tell a cached key id from an unknown one."""
    env = make_env(pg_db)
    _listening(env.services)
    assert env.call("admin", "GET", "/v1/tenants").status_code == 200  # now cached
    reads = _count_key_reads(env.services, monkeypatch)
    wrong = env.keys["admin"][:-1] + ("A" if env.keys["admin"][-1] != "A" else "B")
    unknown = f"kvg_adm_{'0' * 12}_{wrong.rsplit('_', 1)[1]}"
    for key in (wrong, unknown):
        r = env.client.get("/v1/tenants", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401
    assert reads == [wrong, unknown]


@pytest.mark.postgres
def test_a_revoked_key_is_refused_on_the_next_request_in_another_process(
    make_env: MakeEnv, second: Instance
) -> None:
    env = make_env(second.services.config.db_url)
    _listening(env.services, second.services)
    auditor = env.keys["auditor"]
    assert (
        second.get(auditor) == 200 and env.call("auditor", "GET", "/v1/tenants").status_code == 200
    )
    assert second.services.keys.cached(auditor) is not None  # cached in the other process
    env.services.keys.revoke(_key_id(auditor))  # returns once no process takes it
    assert second.get(auditor) == 401
    assert env.call("auditor", "GET", "/v1/tenants").status_code == 401
    assert second.get(env.keys["admin"]) == 200  # the other keys stay cached and valid


@pytest.mark.postgres
def test_a_revocation_by_the_cli_path_is_seen_by_every_process(
    make_env: MakeEnv, second: Instance
) -> None:
    """`kvguard keys revoke` revokes from a process without a cache, inside an operator
    transaction, then settles: both API processes refuse the key on their next request."""
    env = make_env(second.services.config.db_url)
    _listening(env.services, second.services)
    acme = env.keys["acme"]
    assert second.get(acme) == 200 and env.call("acme", "GET", "/v1/tenants").status_code == 200
    keys = ApiKeys(create_engine(env.services.config.db_url))
    key_id = _key_id(acme)
    record_operator_change(
        keys.engine,
        lambda conn: keys.revoke(key_id, conn=conn),
        lambda _none: operator_event("api_key.revoke", key_id=key_id),
    )
    keys.settle(key_id)
    assert second.get(acme) == 401
    assert env.call("acme", "GET", "/v1/tenants").status_code == 401
    keys.engine.dispose()


@pytest.mark.postgres
def test_with_the_listener_connection_cut_a_revoked_key_is_still_refused(
    make_env: MakeEnv, second: Instance
) -> None:
    """The other process's listener loses its connection: its cache is dropped and, until it
    listens again, every request reads its key row; a revocation made meanwhile holds at once."""
    env = make_env(second.services.config.db_url)
    cache = second.services.key_cache
    assert cache is not None
    _listening(env.services, second.services)
    auditor, admin = env.keys["auditor"], env.keys["admin"]
    assert second.get(auditor) == 200 and second.get(admin) == 200
    pid = cache.backend_pid
    admin_engine = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin_engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.pg_terminate_backend(pid))).scalar_one()
    admin_engine.dispose()
    # No sleep: the cut is noticed by the listener, or else its lease runs out within LEASE_S.
    env.services.keys.revoke(_key_id(auditor))
    assert second.get(auditor) == 401
    assert second.get(admin) == 200  # read from the database while the listener reconnects
    assert cache.wait_listening(10) and cache.backend_pid != pid
    assert second.get(admin) == 200 and second.services.keys.cached(admin) is not None
    assert second.get(auditor) == 401


def test_sqlite_processes_cache_nothing(env: ApiEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.services.key_cache is None
    reads = _count_key_reads(env.services, monkeypatch)
    for _ in range(2):
        assert env.call("admin", "GET", "/v1/tenants").status_code == 200
    assert len(reads) == 2


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _unstarted_cache(clock: _Clock) -> KeyCache:
    return KeyCache(sa.create_engine("sqlite://"), clock=clock)  # the thread is never started


ENTRY = CachedKey(b"s" * 16, b"h" * 32, Role.ADMIN.value, None)


def test_entries_are_used_only_within_the_lease() -> None:
    clock = _Clock()
    cache = _unstarted_cache(clock)
    cache.put("k1", ENTRY, cache.generation)
    assert cache.get("k1") is None  # no lease yet: nothing is taken from the cache
    cache._lease_until = clock.now + LEASE_S  # what a returned token gives
    assert cache.get("k1") == ENTRY
    clock.now += LEASE_S
    assert cache.get("k1") is None  # the lease ran out: the row is read again


def test_a_row_read_before_a_revocation_is_not_cached_after_it() -> None:
    """The race of point 6: a request reads the row, a revocation is applied, then the request
    caches what it read. The older row must not come back."""
    clock = _Clock()
    cache = _unstarted_cache(clock)
    cache._lease_until = clock.now + LEASE_S
    read_from = cache.generation  # the request starts reading
    cache._on_notify(type("N", (), {"payload": "k1"})())  # a revocation of k1 is applied
    cache.put("k1", ENTRY, read_from)
    assert cache.get("k1") is None
    cache.put("k1", ENTRY, cache.generation)
    assert cache.get("k1") == ENTRY
    cache._on_notify(type("N", (), {"payload": "lease:someone-else:1"})())  # another's token
    assert cache.get("k1") == ENTRY
    cache._on_notify(type("N", (), {"payload": ""})())  # a change without a key id
    assert cache.get("k1") is None
