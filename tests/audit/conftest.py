"""Shared fixtures for the audit ledger tests: factories, not shared state (STYLE.md habit 8)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kvguard.audit.events import AuditEvent
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from tests.dbs import fresh_pg_database

CONFORMANCE = Path(__file__).resolve().parents[1] / "conformance"  # provenance: its README.md
T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
ORIGIN = (
    "log.kvguard.test/audit"  # the `open_ledger` ledgers' origin (their key is named otherwise)
)


def conformance_dir(name: str) -> Path:
    """The conformance folder `name` carried in tests/conformance/ (never skipped)."""
    path = CONFORMANCE / name
    assert path.is_dir(), f"conformance vectors missing at {path}"
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
    with fresh_pg_database("kvg_audit") as url:
        yield url


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
        ledger = Ledger.open(url, origin=ORIGIN, **kwargs)  # type: ignore[arg-type]
        opened.append(ledger)
        return ledger

    yield factory
    for ledger in opened:
        ledger.close()


def unpack_stream(stream: Any, into: Path) -> Path:
    """Unpack a `BundleStream` (a tar, maybe gzip) under `into`; returns its bundle directory."""
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream)), mode="r:*") as tar:
        tar.extractall(into, filter="data")
    return Path(into) / stream.name
