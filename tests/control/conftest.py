"""Database fixtures for the control-plane tests: a fresh SQLite file or PostgreSQL database per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dbs import fresh_pg_database


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A freshly created PostgreSQL database for one test, dropped afterwards."""
    with fresh_pg_database("kvg_control") as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'control.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """The same test on a fresh SQLite file and on a fresh PostgreSQL database."""
    return str(request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url"))
