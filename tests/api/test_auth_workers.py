"""The failed-authentication limit under `kvguard serve --workers 2` (found by an independent review).

docs/api.md: "Once either has failed 10 times in 60 s, further failing requests get 429". Each
worker's limiter (`kvguard.api.auth.FailureLimiter`) counted only the failures it saw, so two
workers let a guesser have about twice the documented failures answered 401; the counts are now
shared through the control database (`SharedFailures`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from kvguard.control.keys import ApiKeys, Role
from tests.api.test_crash_consistency import Api

pytestmark = pytest.mark.slow


def test_failure_limit_holds_across_workers(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    engine = sa.create_engine(db_url)
    ApiKeys(engine).create(Role.ADMIN)  # the schema and one real key
    engine.dispose()
    api = Api(db_url, tmp_path)
    api.extra_args = ["--workers", "2"]
    api.start()
    try:
        wrong = {"Authorization": "Bearer kvg_adm_0123456789ab_" + "x" * 43}
        codes = []
        for _ in range(30):
            # a new connection each time, as a spraying client would open them
            codes.append(httpx.get(f"{api.url}/v1/tenants", headers=wrong, timeout=10).status_code)
    finally:
        api.stop()
    assert codes[:10] == [401] * 10, codes
    assert codes[10:] == [429] * 20, codes
