"""Shared fixtures for the audit ledger tests: factories, not shared state (STYLE.md habit 8)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvguard.audit.events import AuditEvent
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey

CONFORMANCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "conformance"
PG_URL = os.environ.get("KVGUARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def conformance_dir(name: str) -> Path:
    """The shared conformance folder `name`, or skip with a clear message where it is absent."""
    path = (CONFORMANCE / name).resolve()
    if not path.is_dir():
        pytest.skip(f"conformance vectors not found at {path}")
    return path


def make_event(i: int, **overrides: object) -> AuditEvent:
    """A valid event, varied by `i` so that rows differ."""
    fields: dict[str, object] = {
        "kind": ["block.alloc", "block.reuse", "block.release", "block.zeroize"][i % 4],
        "scope_tag": f"st-tenant{i % 3}",
        "request_id": f"req-{i // 4}",
        "block_ids": [i % 97, (i * 7) % 97],
        "details": {"blocks": 2, "layer_bytes": 4096, "ok": True, "note": f"n{i}"},
        "ts": T0 + timedelta(milliseconds=i),
    }
    fields.update(overrides)
    return AuditEvent.model_validate(fields)


@pytest.fixture
def key() -> SigningKey:
    return SigningKey.generate("log.kvguard.test")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A freshly created PostgreSQL database for one test, dropped afterwards."""
    name = f"kvg_audit_{uuid.uuid4().hex[:12]}"
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


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """The same test on a fresh SQLite file and on a fresh PostgreSQL database."""
    return str(request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url"))


@pytest.fixture
def open_ledger(key: SigningKey) -> Iterator[Callable[..., Ledger]]:
    """Factory: open ledgers that are closed after the test."""
    opened: list[Ledger] = []

    def factory(url: str, **kwargs: object) -> Ledger:
        kwargs.setdefault("signing_key", key)
        ledger = Ledger.open(url, origin="log.kvguard.test/audit", **kwargs)  # type: ignore[arg-type]
        opened.append(ledger)
        return ledger

    yield factory
    for ledger in opened:
        ledger.close()
