"""Fresh databases for tests that run on SQLite and PostgreSQL alike."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

PG_URL = os.environ.get("KVGUARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@contextmanager
def fresh_pg_database(prefix: str) -> Iterator[str]:
    """A new PostgreSQL database, dropped afterwards; skips the test where PostgreSQL is absent."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {exc.__class__.__name__}")
    url = sa.engine.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextmanager
def pg_roles(url: str) -> Iterator[tuple[str, str, str]]:
    """(owner URL, app URL, app role) on the fresh database `url`: new login roles, the database and
    its public schema owned by the owner (docs/operations.md, "Database"); the roles and what they
    own are dropped afterwards (roles are cluster-wide: none is left behind)."""
    suffix = uuid.uuid4().hex[:8]
    owner, app = f"kvg_owner_{suffix}", f"kvg_app_{suffix}"
    database = sa.engine.make_url(url).database
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {owner} LOGIN")
            conn.exec_driver_sql(f"CREATE ROLE {app} LOGIN")
            conn.exec_driver_sql(f'ALTER DATABASE "{database}" OWNER TO {owner}')
            conn.exec_driver_sql(f"ALTER SCHEMA public OWNER TO {owner}")
        as_user = sa.engine.make_url(url)
        yield (
            as_user.set(username=owner).render_as_string(hide_password=False),
            as_user.set(username=app).render_as_string(hide_password=False),
            app,
        )
    finally:
        admin.dispose()  # a test may have terminated its pooled connection: connect afresh
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE usename IN ('{owner}', '{app}') AND pid <> pg_backend_pid()"
            )
            conn.exec_driver_sql(f'ALTER DATABASE "{database}" OWNER TO postgres')
            for role in (owner, app):
                conn.exec_driver_sql(f"REASSIGN OWNED BY {role} TO postgres")
                conn.exec_driver_sql(f"DROP OWNED BY {role}")
                conn.exec_driver_sql(f"DROP ROLE {role}")
        admin.dispose()


def migrate_and_grant(owner_url: str, app_role: str) -> None:
    """What docs/operations.md prescribes, as the owner: migrate everything (`kvguard db migrate`)
    and run the statements `kvguard db grants APP_ROLE` prints."""
    from kvguard.audit.db import create_engine  # noqa: PLC0415
    from kvguard.audit.migrate import upgrade as upgrade_ledger  # noqa: PLC0415
    from kvguard.control.db import upgrade  # noqa: PLC0415
    from kvguard.control.roles import all_grants  # noqa: PLC0415

    engine = create_engine(owner_url)
    try:
        upgrade_ledger(engine)
        upgrade(engine)
        with engine.begin() as conn:
            for statement in all_grants(app_role):
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


def sqlite_with_tenants(path: os.PathLike[str] | str, *tenants: str) -> str:
    """The URL of a control database at `path` with `tenants` registered: what `kvguard purge`
    needs (an existing database, and a registered tenant for a tenant or session purge)."""
    from kvguard.control.tenants import TenantRegistry  # noqa: PLC0415

    url = f"sqlite:///{path}"
    engine = sa.create_engine(url)
    registry = TenantRegistry(engine)
    for tenant in tenants:
        registry.create(tenant, display_name=tenant, created_by="test")
    engine.dispose()
    return url
