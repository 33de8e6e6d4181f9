"""The API and the engines on PostgreSQL under exactly the roles and grants docs/operations.md
prescribes: an owner migrates (`kvguard db migrate`) and runs `kvguard db grants APP` output; every
serving path then runs as the app role (issue 11 item 9: 0.1.0's documented grants omitted USAGE on
the command id sequence, so every purge and policy write failed after storing the policy version)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kvguard.api.app import create_app
from kvguard.api.services import Services
from kvguard.cli import app as cli_app
from kvguard.control.commands import CommandListener
from kvguard.control.db import open_engine
from kvguard.control.engines import TenantCacheStats
from kvguard.control.keys import ApiKeys, Role, TenantKeys
from kvguard.control.roles import app_role_grants
from kvguard.policy.store import PolicyStore
from tests.api.conftest import make_config
from tests.api.purge_support import SimEngine, scope
from tests.dbs import fresh_pg_database, pg_roles

pytestmark = pytest.mark.postgres


@pytest.fixture
def role_urls() -> Iterator[tuple[str, str, str]]:
    """(owner URL, app URL, app role) on a fresh database owned by a fresh owner role."""
    with fresh_pg_database("kvg_roles") as url, pg_roles(url) as roles:
        yield roles


def _setup_as_owner(owner_url: str, app: str) -> None:
    runner = CliRunner()
    migrated = runner.invoke(cli_app, ["db", "migrate", "--db", owner_url])
    assert migrated.exit_code == 0, migrated.output
    printed = runner.invoke(cli_app, ["db", "grants", app])
    assert printed.exit_code == 0, printed.output
    engine = sa.create_engine(owner_url)
    with engine.begin() as conn:
        for statement in printed.output.strip().split(";\n"):
            conn.exec_driver_sql(statement.rstrip(";"))
    engine.dispose()


def test_api_and_engine_paths_run_as_the_app_role(
    role_urls: tuple[str, str, str], tmp_path: Path
) -> None:
    owner_url, app_url, app = role_urls
    _setup_as_owner(owner_url, app)
    config, _key = make_config(tmp_path, app_url)
    services = Services.open(config)  # as the app role: no DDL needed
    try:
        admin_key = services.keys.create(Role.ADMIN).api_key
        client = TestClient(create_app(services))
        h = {"Authorization": f"Bearer {admin_key}"}
        engine = SimEngine(services, "engine-app-role")  # registers, reads commands as the app
        assert client.post("/v1/tenants", json={"tenant_id": "acme"}, headers=h).status_code == 201
        engine.cache(scope("acme"), [0, 1])
        policy = {"policy": {"retention": {"ttl_s": 60, "idle_s": 30}}, "reason": "r"}
        r = client.put("/v1/tenants/acme/policy", json=policy, headers=h)
        assert r.status_code == 201, r.text
        r = client.post("/v1/purges", json={"kind": "tenant", "value": "acme"}, headers=h)
        assert r.status_code == 202, r.text
        job = r.json()["job_id"]
        assert engine.run_commands() == 1
        engine.zeroize()
        assert client.get(f"/v1/purges/{job}", headers=h).json()["status"] == "done"
        assert client.get(f"/v1/purges/{job}/certificate", headers=h).status_code == 200
        key = client.post("/v1/tenants/acme/inference-keys", headers=h)
        assert key.status_code == 201, key.text
        front_end = TenantKeys.open(app_url)  # the serving front end, as the app role
        assert front_end.tenant_for(key.json()["api_key"]) == "acme"
        revoke = f"/v1/tenants/acme/inference-keys/{key.json()['key_id']}/revoke"
        assert client.post(revoke, headers=h).status_code == 200
        r = client.post("/v1/tenants/acme/disable", json={"reason": "r"}, headers=h)
        assert r.status_code == 200, r.text
        back = {"policy": {"enabled": True}, "reason": "back"}  # the registry update in the CTE
        seen = {**h, "If-Match": client.get("/v1/policies/current", headers=h).headers["ETag"]}
        assert client.put("/v1/tenants/acme/policy", json=back, headers=seen).status_code == 201
        assert client.get("/v1/tenants/acme", headers=h).json()["enabled"] is True
        r = client.post("/v1/tenants/acme/disable", json={"reason": "again"}, headers=h)
        assert r.status_code == 200, r.text
        services.engines.heartbeat(
            engine.engine_id,
            now=time.time(),
            totals={"requests": 1},
            tenants=[TenantCacheStats(engine.engine_id, "acme", "tt_x", blocks_cached=1)],
            new_tags=[("st_x", "acme")],
        )
        listener = CommandListener(open_engine(app_url)).start()
        assert listener.wait_listening(10)
        listener.close()
        engine_store = PolicyStore.open(app_url)  # the engine's policy reads
        assert engine_store.current() is not None
        engine_store.engine.dispose()
        assert services.outbox.pending() == 0
        # What the app role may not do, whatever the code: rewrite history or change the schema.
        for statement in (
            "DELETE FROM policy_versions",
            "UPDATE engine_commands SET kind = 'x'",
            "DELETE FROM engine_commands",
            "DELETE FROM control_outbox",
            "DROP TABLE tenants",
            "ALTER TABLE tenants ADD COLUMN x int",
        ):
            with services.db.connect() as conn, pytest.raises(sa.exc.DBAPIError):
                conn.exec_driver_sql(statement)
    finally:
        services.close()


def test_grants_cover_every_control_table_and_sequence() -> None:
    statements = app_role_grants("kvguard_app")
    assert "GRANT USAGE ON SEQUENCE engine_commands_id_seq TO kvguard_app" in statements
    assert "GRANT USAGE ON SEQUENCE control_outbox_id_seq TO kvguard_app" in statements
    with pytest.raises(ValueError, match="identifiers"):
        app_role_grants("app; DROP TABLE tenants")


def test_admin_keys_made_by_the_owner_work_for_the_app(role_urls: tuple[str, str, str]) -> None:
    owner_url, app_url, app = role_urls
    _setup_as_owner(owner_url, app)
    issued = ApiKeys(open_engine(owner_url)).create(Role.AUDITOR)
    assert ApiKeys(open_engine(app_url)).authenticate(issued.api_key) == issued.principal
