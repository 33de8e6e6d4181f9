"""The authorization matrix: every endpoint x every role, including a tenant_admin reaching for another
tenant's data (404 or 403, never data) and calls without a key (401).

`MATRIX` must name every route the app serves: a new endpoint without a row fails
`test_matrix_covers_every_route`, so nobody can add an endpoint without deciding who may call it.
Each row gives a request for the caller's own tenant (`{own}`) and one aimed at the other tenant
(`{other}`); `globex` is the other tenant for the `acme` tenant_admin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.routing import APIRoute

from kvguard.audit.events import AuditEvent
from tests.api.conftest import ApiEnv

ALL = frozenset({"admin", "auditor", "tenant"})
GLOBAL = frozenset({"admin", "auditor"})
ADMIN = frozenset({"admin"})
TENANT_WRITE = frozenset({"admin", "tenant"})
OPEN = frozenset({"anyone"})


@dataclass(frozen=True)
class Row:
    method: str
    path: str  # the route template, as FastAPI knows it
    allowed: frozenset[str]
    url: str = ""  # concrete URL; `{own}` / `{other}` are replaced by tenant ids
    body: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    tenant_scoped: bool = False  # has a tenant in the URL/body: also try the other tenant
    setup: Callable[[ApiEnv], Any] | None = None  # makes what the URL names (e.g. a job)

    def prepare(self, env: ApiEnv) -> None:
        if self.setup is not None:
            self.setup(env)

    def request(self, tenant: str) -> tuple[str, dict[str, Any]]:
        url = (self.url or self.path).replace("{own}", tenant)
        kwargs: dict[str, Any] = {"params": _fill(self.params, tenant)}
        if self.body is not None:
            kwargs["json"] = _fill(self.body, tenant)
        return url, kwargs


def _fill(value: Any, tenant: str) -> Any:
    if isinstance(value, dict):
        return {k: _fill(v, tenant) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tenant) for v in value]
    return value.replace("{own}", tenant) if isinstance(value, str) else value


_POLICY = {"retention": {"ttl_s": 600, "idle_s": 60}}


def _acme_purge_job(env: ApiEnv) -> None:
    """Purge job 1, of tenant acme: done at once (no engine is live)."""
    r = env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "acme"})
    assert r.json()["job_id"] == 1, r.text


def _acme_ledger_entry(env: ApiEnv) -> None:
    """Ledger entry 0 carries acme's tag, and a checkpoint covers it."""
    tag = env.services.deriver.tenant_tag("acme")
    event = AuditEvent(kind="block.alloc", scope_tag=tag, ts=datetime.now(UTC))
    assert env.services.ledger.append(event) == 0
    env.services.ledger.checkpoint()


def _acme_inference_key(env: ApiEnv) -> None:
    """Inference key `0123456789ab` of tenant acme (a fixed id, so that a URL can name it)."""
    import sqlalchemy as sa  # noqa: PLC0415

    from kvguard.control.schema import TenantKeyRow  # noqa: PLC0415

    with env.services.db.begin() as conn:
        conn.execute(
            sa.insert(TenantKeyRow).values(
                key_id="0123456789ab",
                secret_sha256=bytes(32),
                tenant_id="acme",
                created_at=0.0,
                revoked=False,
            )
        )


MATRIX: list[Row] = [
    Row("GET", "/healthz", OPEN),
    Row("GET", "/readyz", OPEN),
    Row("POST", "/v1/tenants", ADMIN, body={"tenant_id": "new-{own}"}),
    Row("GET", "/v1/tenants", ALL),
    Row("GET", "/v1/tenants/{tenant_id}", ALL, url="/v1/tenants/{own}", tenant_scoped=True),
    Row(
        "POST",
        "/v1/tenants/{tenant_id}/disable",
        ADMIN,
        url="/v1/tenants/{own}/disable",
        body={"reason": "matrix"},
        tenant_scoped=True,
    ),
    Row(
        "POST",
        "/v1/tenants/{tenant_id}/inference-keys",
        TENANT_WRITE,
        url="/v1/tenants/{own}/inference-keys",
        tenant_scoped=True,
    ),
    Row(
        "GET",
        "/v1/tenants/{tenant_id}/inference-keys",
        ALL,
        url="/v1/tenants/{own}/inference-keys",
        tenant_scoped=True,
    ),
    Row(
        "POST",
        "/v1/tenants/{tenant_id}/inference-keys/{key_id}/revoke",
        TENANT_WRITE,
        url="/v1/tenants/acme/inference-keys/0123456789ab/revoke",
        setup=_acme_inference_key,
    ),
    Row("GET", "/v1/policies/current", GLOBAL),
    Row("PUT", "/v1/policies", ADMIN, body={"policy": {}, "reason": "matrix"}),
    Row("GET", "/v1/policies/history", GLOBAL),
    Row("GET", "/v1/policies/versions/{version}", GLOBAL, url="/v1/policies/versions/0"),
    Row("GET", "/v1/policies/diff", GLOBAL, params={"from_version": 0, "to_version": 0}),
    Row(
        "GET",
        "/v1/tenants/{tenant_id}/policy",
        ALL,
        url="/v1/tenants/{own}/policy",
        tenant_scoped=True,
    ),
    Row(
        "PUT",
        "/v1/tenants/{tenant_id}/policy",
        TENANT_WRITE,
        url="/v1/tenants/{own}/policy",
        body={"policy": _POLICY, "reason": "matrix"},
        tenant_scoped=True,
    ),
    Row("GET", "/v1/cache/tenants", ALL),
    Row(
        "GET",
        "/v1/cache/tenants",
        ALL,
        params={"tenant_id": "{own}"},
        tenant_scoped=True,
    ),
    Row("GET", "/v1/cache/engines", GLOBAL),
    Row("GET", "/metrics", GLOBAL),
    Row(
        "POST",
        "/v1/purges",
        TENANT_WRITE,
        body={"kind": "session", "value": "s-1", "tenant_id": "{own}"},
        tenant_scoped=True,
    ),
    Row("GET", "/v1/purges", ALL),
    Row("GET", "/v1/purges", ALL, params={"tenant_id": "{own}"}, tenant_scoped=True),
    Row("GET", "/v1/purges/{job_id}", ALL, url="/v1/purges/1", setup=_acme_purge_job),
    Row(
        "GET",
        "/v1/purges/{job_id}/certificate",
        ALL,
        url="/v1/purges/1/certificate",
        setup=_acme_purge_job,
    ),
    Row("GET", "/v1/audit/entries", ALL),
    Row("GET", "/v1/audit/entries", ALL, params={"tenant_id": "{own}"}, tenant_scoped=True),
    Row(
        "GET", "/v1/audit/entries/{index}", ALL, url="/v1/audit/entries/0", setup=_acme_ledger_entry
    ),
    Row("GET", "/v1/audit/checkpoints/latest", ALL, setup=_acme_ledger_entry),
    Row("GET", "/v1/audit/checkpoints", ALL),
    Row("POST", "/v1/audit/checkpoints", ADMIN),
    Row(
        "GET",
        "/v1/audit/consistency",
        ALL,
        params={"old_size": 1, "new_size": 1},
        setup=_acme_ledger_entry,
    ),
    Row("GET", "/v1/audit/export", ALL),
    Row("GET", "/v1/audit/export", ALL, params={"tenant_id": "{own}"}, tenant_scoped=True),
]

CALLERS = {"admin": "admin", "auditor": "auditor", "tenant": "acme"}


def test_matrix_covers_every_route(env: ApiEnv) -> None:
    served = {
        (method, route.path)
        for route in env.client.app.routes  # type: ignore[attr-defined]
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods
    }
    listed = {(row.method, row.path) for row in MATRIX}
    assert served - listed == set(), "endpoints without an authorization decision"
    assert listed - served == set(), "matrix rows for endpoints that do not exist"


@pytest.mark.parametrize("row", MATRIX, ids=lambda r: f"{r.method} {r.path}")
def test_roles(env: ApiEnv, row: Row) -> None:
    row.prepare(env)
    for role, who in CALLERS.items():
        url, kwargs = row.request("acme")
        response = env.call(who, row.method, url, **kwargs)
        if "anyone" in row.allowed or role in row.allowed:
            assert response.status_code not in (401, 403, 404), (role, response.text)
            assert response.status_code < 500, (role, response.text)
        else:
            assert response.status_code == 403, (role, response.status_code, response.text)


@pytest.mark.parametrize(
    "row", [r for r in MATRIX if r.tenant_scoped], ids=lambda r: f"{r.method} {r.path}"
)
def test_tenant_admin_cannot_reach_another_tenant(env: ApiEnv, row: Row) -> None:
    row.prepare(env)
    url, kwargs = row.request("globex")
    response = env.call("acme", row.method, url, **kwargs)
    assert response.status_code in (403, 404), response.text
    assert "Globex" not in response.text  # the other tenant's display name never leaks


@pytest.mark.parametrize(
    "row", [r for r in MATRIX if "anyone" not in r.allowed], ids=lambda r: f"{r.method} {r.path}"
)
def test_no_key_no_entry(env: ApiEnv, row: Row) -> None:
    row.prepare(env)
    url, kwargs = row.request("acme")
    response = env.call(None, row.method, url, **kwargs)
    assert response.status_code == 401, response.text


def test_tenant_admin_cannot_reach_another_tenants_jobs_entries_or_exports(env: ApiEnv) -> None:
    """Objects addressed by id, not by tenant: globex's purge job, its certificate, its ledger
    entry. acme's tenant_admin gets 404 for each, and acme's own export holds none of them."""
    job = env.call("admin", "POST", "/v1/purges", json={"kind": "tenant", "value": "globex"})
    job_id = job.json()["job_id"]
    tag = env.services.deriver.tenant_tag("globex")
    index = env.services.ledger.append(
        AuditEvent(kind="block.alloc", scope_tag=tag, ts=datetime.now(UTC))
    )
    env.services.ledger.checkpoint()
    for url in (
        f"/v1/purges/{job_id}",
        f"/v1/purges/{job_id}/certificate",
        f"/v1/audit/entries/{index}",
    ):
        response = env.call("acme", "GET", url)
        assert response.status_code == 404, (url, response.text)
        assert tag not in response.text
    assert env.call("globex", "GET", f"/v1/purges/{job_id}").status_code == 200
    listed = env.call("acme", "GET", "/v1/audit/entries").json()["entries"]
    assert all(e["scope_tag"] != tag for e in listed)
    export = env.call("acme", "GET", "/v1/audit/export")
    assert export.status_code == 200 and tag.encode() not in export.content
