"""The control schema's migrations: a database made by kvguard 0.1.0 is upgraded with its data kept.

`data/v0_1_0/kvguard-0.1.0.db` was made by the 0.1.0 release's own code (`make_fixture.py.txt`, run
against a checkout of commit 105a1e9): two tenants, an admin and a tenant_admin key (scrypt hashes),
a policy version (and its engine command, acknowledged), a purge job, an inference key and an engine row, all with
their ledger entries. On PostgreSQL the same 0.1.0 layout is made by revision 0001 alone, with the
version table dropped afterwards, as 0.1.0's `create_all` left it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from kvguard.api.app import create_app
from kvguard.api.services import ApiConfig, Services
from kvguard.control import db as control_db
from kvguard.control.commands import CommandQueue, PurgeCommand, PurgeKind, PurgeSelector
from kvguard.control.keys import ApiKeys, Role, TenantKeys
from kvguard.control.schema import AdminKeyRow
from kvguard.policy.store import PolicyStore

DATA = Path(__file__).parent / "data" / "v0_1_0"


@pytest.fixture
def old_db(tmp_path: Path) -> Path:
    for item in DATA.iterdir():
        shutil.copy(item, tmp_path / item.name)
        (tmp_path / item.name).chmod(0o600)  # git keeps no modes: secrets must be 0600 to load
    return tmp_path


def _config(directory: Path) -> ApiConfig:
    return ApiConfig(
        db_url=f"sqlite:///{directory / 'kvguard-0.1.0.db'}",
        signing_key_file=directory / "signing.key",
        salt_keyring_file=directory / "salt.keys",
        origin="kvguard.test/ledger",
        checkpoint_interval_s=None,
    )


def test_a_0_1_0_database_upgrades_with_its_data(old_db: Path) -> None:
    url = f"sqlite:///{old_db / 'kvguard-0.1.0.db'}"
    raw = sa.create_engine(url)
    assert control_db.current_revision(raw) is None  # 0.1.0 had no control version table
    raw.dispose()
    admin_key, tenant_admin_key, inference_key = (old_db / "keys.txt").read_text().split()

    services = Services.open(_config(old_db))  # opening runs the migrations
    try:
        assert control_db.current_revision(services.db) == control_db.head_revision()
        assert [t.tenant_id for t in services.tenants.list()] == ["acme", "globex"]
        current = services.policies.current()
        assert current is not None and current.change.version == 1
        assert current.policy.policy_for("acme").retention.ttl_s == 120
        assert services.inference_keys.tenant_for(inference_key) == "acme"
        old_policy, old_job = services.commands.pending_after(0)
        assert isinstance(old_job, PurgeCommand) and old_job.selector.value == "globex"
        assert [old_policy.seq, old_job.seq] == [1, 2]  # 0.1.0 commands numbered by id
        assert services.commands.acks(old_policy.id)[0]["engine_id"] == "engine-old"
        assert [e.engine_id for e in services.engines.engines()] == ["engine-old"]
        new_job = services.commands.submit_purge(
            PurgeSelector(PurgeKind.TENANT, "acme"), requested_by="t"
        )
        assert [c.id for c in services.commands.pending_after(old_job.seq)] == [new_job]

        # 0.1.0 admin keys carry scrypt hashes: they still work, and switch to HMAC on first use.
        client = TestClient(create_app(services))
        ok = client.get("/v1/tenants", headers={"Authorization": f"Bearer {admin_key}"})
        assert ok.status_code == 200, ok.text
        with services.db.connect() as conn:
            rows = conn.execute(sa.select(AdminKeyRow.secret_scrypt, AdminKeyRow.secret_hash)).all()
        upgraded = [r for r in rows if r.secret_hash is not None and r.secret_scrypt is None]
        assert len(upgraded) == 1 and len(rows) == 2
        mine = client.get(
            "/v1/tenants/acme/policy", headers={"Authorization": f"Bearer {tenant_admin_key}"}
        )
        assert mine.status_code == 200
        bad = client.get("/v1/tenants", headers={"Authorization": f"Bearer {admin_key[:-1]}A"})
        assert bad.status_code == 401
        # The ledger made by 0.1.0 still verifies (verify raises otherwise), with new entries.
        before = services.ledger.size
        services.deliver()
        assert services.ledger.verify().size >= before
    finally:
        services.close()


def test_migrations_are_idempotent_and_race_free(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    engines = [control_db.open_engine(url) for _ in range(3)]
    for engine in engines:
        control_db.upgrade(engine)
        assert control_db.current_revision(engine) == control_db.head_revision()
        engine.dispose()


@pytest.mark.postgres
def test_postgres_0_1_0_layout_upgrades(pg_url: str) -> None:
    engine = control_db.create_engine(pg_url)
    control_db.upgrade(engine, "0001_control_0_1")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {control_db.VERSION_TABLE}")  # as create_all left it
        conn.exec_driver_sql(
            "INSERT INTO engine_commands (kind, selector_kind, selector_value, tenant_id,"
            " requested_by, created_at) VALUES ('purge', 'tenant', 'acme', NULL, 'x', 1.0)"
        )
    engine.dispose()
    keys = ApiKeys(control_db.open_engine(pg_url))
    issued = keys.create(Role.ADMIN)
    assert keys.authenticate(issued.api_key) == issued.principal
    queue = CommandQueue.open(pg_url)
    (old,) = queue.pending_after(0)
    assert old.seq == 1
    new = queue.submit_policy(1, requested_by="t")
    assert [c.id for c in queue.pending_after(1)] == [new]
    store = PolicyStore.open(pg_url)
    assert store.put(store_policy(), author="a", reason="r") == 1
    TenantKeys.open(pg_url)
    queue.engine.dispose()
    store.engine.dispose()


def store_policy():  # type: ignore[no-untyped-def]
    from kvguard.policy import PolicySet  # noqa: PLC0415

    return PolicySet()


def test_a_new_sqlite_database_and_its_wal_are_private(tmp_path: Path) -> None:
    path = tmp_path / "kvguard.db"
    engine = control_db.open_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql("SELECT 1")
    for file in (path, path.with_name("kvguard.db-wal")):
        assert file.exists() and file.stat().st_mode & 0o777 == 0o600, file
    engine.dispose()


@pytest.mark.postgres
def test_postgres_outbox_is_vacuumed_after_a_fixed_number_of_drained_rows() -> None:
    """Each admin write leaves a dead outbox row version that every drain's pending read walks
    until a vacuum: autovacuum's default (a fifth of the table dead) grows with the history the
    outbox keeps. Migration 0008 sets a fixed threshold (and SQLite needs none)."""
    from tests.dbs import fresh_pg_database  # noqa: PLC0415

    with fresh_pg_database("kvg_vacuum") as url:
        engine = control_db.open_engine(url)
        try:
            with engine.connect() as conn:
                options = conn.exec_driver_sql(
                    "SELECT reloptions FROM pg_class WHERE relname = 'control_outbox'"
                ).scalar_one()
        finally:
            engine.dispose()
    assert options is not None, "control_outbox keeps autovacuum's scale-factor default"
    settings = dict(o.split("=", 1) for o in options)
    assert settings["autovacuum_vacuum_scale_factor"] == "0"
    assert settings["autovacuum_analyze_scale_factor"] == "0"
    assert 0 < int(settings["autovacuum_vacuum_threshold"]) <= 10_000
    assert 0 < int(settings["autovacuum_analyze_threshold"]) <= 10_000
