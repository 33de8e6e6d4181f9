"""Fixtures for the admin API tests: a real app on a fresh SQLite file or PostgreSQL database, with
one key per role (factories, not shared state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvguard.api.app import create_app
from kvguard.api.auth import Role
from kvguard.api.services import ApiConfig, Services
from kvguard.audit.signing import SigningKey
from kvguard.isolation.keyring import Keyring
from tests.dbs import fresh_pg_database, migrate_and_grant, pg_roles

TENANTS = ("acme", "globex")


@dataclass
class ApiEnv:
    client: TestClient
    services: Services
    keys: dict[str, str] = field(default_factory=dict)  # "admin", "auditor", "acme", "globex"
    signing_key: SigningKey | None = None

    def headers(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    def call(self, who: str | None, method: str, url: str, **kwargs: Any) -> Any:
        headers = {**(self.headers(who) if who else {}), **kwargs.pop("headers", {})}
        return self.client.request(method, url, headers=headers, **kwargs)


def make_config(directory: Path, db_url: str, **overrides: Any) -> tuple[ApiConfig, SigningKey]:
    key = SigningKey.generate("kvguard.test/ledger")
    key.save(directory / "signing.key")
    Keyring.generate("k1").save(directory / "salt.keys")
    config = ApiConfig(
        db_url=db_url,
        signing_key_file=directory / "signing.key",
        salt_keyring_file=directory / "salt.keys",
        origin="kvguard.test/ledger",
        checkpoint_interval_s=None,
        **overrides,
    )
    return config, key


@pytest.fixture
def pg_db() -> Iterator[str]:
    """A fresh PostgreSQL database used as production uses it (docs/operations.md): migrated by an
    owner role, the API connecting as an app role with exactly the grants `kvguard db grants`
    prints."""
    with fresh_pg_database("kvg_api") as url, pg_roles(url) as (owner_url, app_url, app):
        migrate_and_grant(owner_url, app)
        yield app_url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kvguard.db'}"
    return str(request.getfixturevalue("pg_db"))


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator[Callable[..., ApiEnv]]:
    opened: list[ApiEnv] = []

    def factory(db_url: str | None = None, **overrides: Any) -> ApiEnv:
        url = db_url or f"sqlite:///{tmp_path / 'kvguard.db'}"
        directory = tmp_path / f"env{len(opened)}"
        directory.mkdir()
        config, key = make_config(directory, url, **overrides)
        services = Services.open(config)
        client = TestClient(create_app(services))
        env = ApiEnv(client, services, signing_key=key)
        env.keys["admin"] = services.keys.create(Role.ADMIN).api_key
        env.keys["auditor"] = services.keys.create(Role.AUDITOR).api_key
        for tenant in TENANTS:
            services.tenants.create(tenant, display_name=tenant.title(), created_by="test")
            env.keys[tenant] = services.keys.create(Role.TENANT_ADMIN, tenant_id=tenant).api_key
        opened.append(env)
        return env

    yield factory
    for env in opened:
        env.client.close()
        env.services.close()


@pytest.fixture
def env(make_env: Callable[..., ApiEnv]) -> ApiEnv:
    return make_env()
