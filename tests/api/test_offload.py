"""`OneHopRoute` (`kvguard.api.offload`): a route's work runs on a worker thread in one hop, and
its answer is validated and serialized on the event loop. With the caller's key in the key cache
(PostgreSQL) a read makes exactly one thread hop; before, FastAPI made one for the route, one for
the response and the request gate one for the key row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio.to_thread
import pytest

from kvguard.api.offload import OneHopRoute
from tests.api.conftest import ApiEnv

MakeEnv = Callable[..., ApiEnv]


def _count_hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    hops: list[str] = []
    real = anyio.to_thread.run_sync

    async def counted(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(func, "__name__", repr(func)))
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    return hops


def test_every_api_route_is_a_one_hop_route(env: ApiEnv) -> None:
    api = [r for r in env.client.app.routes if getattr(r, "path", "").startswith("/v1/")]
    assert api and all(isinstance(r, OneHopRoute) for r in api if "dashboard" not in r.path)


@pytest.mark.postgres
def test_a_read_with_a_cached_key_makes_one_thread_hop(
    make_env: MakeEnv, pg_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_env(pg_db)
    assert env.services.key_cache is not None and env.services.key_cache.wait_listening(10)
    assert env.call("acme", "GET", "/v1/tenants/acme").status_code == 200  # caches the key
    hops = _count_hops(monkeypatch)
    for path in ("/v1/tenants/acme", "/v1/tenants", "/v1/tenants/acme/policy"):
        hops.clear()
        r = env.call("acme", "GET", path)
        assert r.status_code == 200, r.text
        assert len(hops) == 1, (path, hops)


def test_errors_raised_on_the_worker_thread_answer_as_before(env: ApiEnv) -> None:
    r = env.call("acme", "GET", "/v1/tenants/globex")  # another tenant's: 404, not 500
    assert r.status_code == 404 and r.json()["error"] == "not_found"
