"""Listing purge jobs costs O(page), not O(all purges) (issue 11 item 7: `GET /v1/purges?limit=100`
by a tenant_admin took 18 s, each listed job scanning every purge entry since its creation).

Measured without a clock: the SQL statements a listing runs and the ledger leaves it parses, for
the same page of jobs while the ledger holds 50 and then 200 other jobs' purge, clear and request
entries (reusing the same block ids, as engines do). Neither may grow."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from kvguard.api import purge_jobs
from kvguard.audit import erasure
from kvguard.audit.erasure_query import CLOCK_SKEW_S
from tests.api.conftest import ApiEnv
from tests.api.purge_support import SimEngine, scope
from tests.audit.test_entry_commands import old_find_job_evidence

PAGE = 5


@dataclass
class Cost:
    statements: int = 0
    leaves_parsed: int = 0
    registry_reads: int = 0
    ack_reads: int = 0


@contextmanager
def measured(env: ApiEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cost]:
    """Count the statements on the control and ledger databases, the leaves parsed, and the reads
    of the engine registry and of acknowledgements."""
    cost = Cost()
    parse, registry, acks = (
        erasure.parse_leaf,
        env.services.engines.engines,
        env.services.commands.acks_for,
    )

    def counting_parse(leaf: bytes) -> dict[str, Any]:
        cost.leaves_parsed += 1
        return parse(leaf)

    def counting_registry(*args: Any) -> Any:
        cost.registry_reads += 1
        return registry(*args)

    def counting_acks(command_ids: Any, *args: Any) -> Any:
        cost.ack_reads += 1
        return acks(command_ids, *args)

    def count(*_args: Any) -> None:
        cost.statements += 1

    engines = {env.services.db, env.services.ledger.store.engine}
    with monkeypatch.context() as patch:
        patch.setattr(erasure, "parse_leaf", counting_parse)
        patch.setattr(env.services.engines, "engines", counting_registry)
        patch.setattr(env.services.commands, "acks_for", counting_acks)
        for engine in engines:
            sa.event.listen(engine, "before_cursor_execute", count)
        try:
            yield cost
        finally:
            for engine in engines:
                sa.event.remove(engine, "before_cursor_execute", count)


def _purge_sessions(env: ApiEnv, engine: SimEngine, sessions: range) -> list[int]:
    """One session purge job per session, each with cached blocks that the engine purges and
    clears; block ids come back round, so every job's clears list ids other jobs used too."""
    ids = []
    for i in sessions:
        engine.cache(scope("acme", f"s-{i}"), [i % 8, 8 + i % 5])
        body = {"kind": "session", "value": f"s-{i}", "tenant_id": "acme"}
        r = env.call("acme", "POST", "/v1/purges", json=body)
        assert r.status_code == 202, r.text
        ids.append(int(r.json()["job_id"]))
        engine.run_commands()
        engine.zeroize()
        engine.beat()
    return ids


def _list_page(env: ApiEnv, before: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Cost]:
    params = {"before": before, "limit": PAGE}
    warm = env.call("acme", "GET", "/v1/purges", params=params)  # the API key check is cached
    assert warm.status_code == 200, warm.text
    with measured(env, monkeypatch) as cost:
        r = env.call("acme", "GET", "/v1/purges", params=params)
    assert r.status_code == 200, r.text
    return r.json(), cost


def test_listing_a_page_costs_the_same_whatever_else_the_ledger_holds(
    make_env: Callable[..., ApiEnv], any_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_env(any_db)
    engine = SimEngine(env.services, "engine-one")
    _purge_sessions(env, engine, range(0, 25))
    page_ids = _purge_sessions(env, engine, range(25, 25 + PAGE))
    _purge_sessions(env, engine, range(100, 125))  # 50 other jobs, before and after the page
    before = page_ids[-1] + 1
    small, small_cost = _list_page(env, before, monkeypatch)
    assert [j["job_id"] for j in small["jobs"]] == page_ids[::-1]
    assert {j["status"] for j in small["jobs"]} == {"done"}

    _purge_sessions(env, engine, range(200, 350))  # 200 other jobs
    large, large_cost = _list_page(env, before, monkeypatch)
    assert large == small
    assert large_cost == small_cost, (small_cost, large_cost)
    # a handful of statements per page plus one per purge entry (its clears); the leaves parsed
    # are each job's request, purge and clear entries; the registry and acks are read once
    assert small_cost.statements <= 10 + 2 * PAGE
    assert small_cost.leaves_parsed == 3 * PAGE
    assert (small_cost.registry_reads, small_cost.ack_reads) == (1, 1)


def test_a_listed_job_reads_as_it_does_alone_and_its_evidence_as_the_old_scan_found_it(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    one, two = SimEngine(env.services, "engine-one"), SimEngine(env.services, "engine-two")
    _purge_sessions(env, one, range(0, 6))
    two.cache(scope("acme"), [1, 2])
    one.cache(scope("acme"), [3])
    r = env.call("acme", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    running = int(r.json()["job_id"])
    one.run_commands()
    two.run_commands()
    two.zeroize()  # engine-one has not cleared yet: the job is running
    _purge_sessions(env, two, range(6, 9))
    one.run_commands()  # acknowledges these three too (nothing of theirs in its cache)
    listed = env.call("auditor", "GET", "/v1/purges", params={"limit": 100}).json()["jobs"]
    assert len(listed) == 10 and running in {j["job_id"] for j in listed}
    for job in listed:
        alone = env.call("auditor", "GET", f"/v1/purges/{job['job_id']}").json()
        assert job == alone
    statuses = {j["job_id"]: j["status"] for j in listed}
    assert statuses[running] == "running" and list(statuses.values()).count("done") == 9
    jobs = purge_jobs.list_jobs(env.services, tenant_id=None, before=None, limit=100)
    for job, report in zip(jobs, purge_jobs.reports(env.services, jobs), strict=True):
        created = datetime.fromtimestamp(job.created_at, UTC)
        old = old_find_job_evidence(
            env.services.ledger,
            job.job_id,
            since=created - CLOCK_SKEW_S,
            until=created + CLOCK_SKEW_S,
        )
        assert report.evidence == old and old.request is not None
