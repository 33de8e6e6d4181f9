"""`GET /v1/purges` of one tenant must not read every other tenant's purge job in the database
(found by an independent review).

docs/api.md: "A page of `GET /v1/purges` costs O(its jobs' own ledger entries), not O(all purges)";
issue 11: listing purges costs O(page). Without an index on the tenant columns PostgreSQL walked the
primary key and threw away every other tenant's job: a tenant_admin of a small tenant paid for the
whole platform's purge history on every page. Measured without a clock: the rows PostgreSQL removes
by filter while running the exact statement the API ran."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from tests.api.conftest import ApiEnv

OTHER_JOBS = 20_000


def _rows_filtered(plan: dict[str, Any]) -> int:
    own = int(plan.get("Rows Removed by Filter", 0)) * int(plan.get("Actual Loops", 1))
    return own + sum(_rows_filtered(p) for p in plan.get("Plans", []))


@pytest.mark.postgres
def test_listing_one_tenants_purges_does_not_scan_other_tenants_jobs(
    make_env: Callable[..., ApiEnv], pg_db: str
) -> None:
    env = make_env(pg_db)
    r = env.call(
        "acme", "POST", "/v1/purges", json={"kind": "session", "value": "s1", "tenant_id": "acme"}
    )
    assert r.status_code == 202, r.text
    with env.services.db.begin() as conn:  # the app role: other tenants' purge history
        conn.execute(
            sa.text(
                "INSERT INTO engine_commands (kind, selector_kind, selector_value, tenant_id,"
                " requested_by, created_at, seq) SELECT 'purge', 'session', 's' || g, 'globex',"
                " 'key:x', 0, 1000000 + g FROM generate_series(1, :n) AS g"
            ),
            {"n": OTHER_JOBS},
        )
    seen: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        if "FROM engine_commands" in statement and "ORDER BY" in statement:
            seen.append((statement, parameters))

    sa.event.listen(env.services.db, "before_cursor_execute", capture)
    try:
        page = env.call("acme", "GET", "/v1/purges?limit=20")
    finally:
        sa.event.remove(env.services.db, "before_cursor_execute", capture)
    assert page.status_code == 200 and [j["job_id"] for j in page.json()["jobs"]] == [
        r.json()["job_id"]
    ]
    assert seen, "the listing statement was not captured"
    statement, parameters = seen[0]
    with env.services.db.connect() as conn:
        plan = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters
        ).scalar_one()
    plan = plan if isinstance(plan, list) else json.loads(plan)
    filtered = _rows_filtered(plan[0]["Plan"])
    assert filtered < 1000, f"one page of acme's purges read and discarded {filtered} other jobs"
