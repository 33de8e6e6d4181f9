"""The revocation-coherent key cache through the real thing: `kvguard serve --workers 2` on
PostgreSQL, clients hammering it with a key over keep-alive connections (both worker processes
cache it), and `kvguard keys revoke` run as the operator runs it. Every request sent after the
command returned is refused, in whichever process it lands; none before it is (issue 10 item 9,
issue 11 item 6, with the cache of kvguard.control.key_cache in the path)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from kvguard.control.keys import ApiKeys, Role
from tests.api.test_crash_consistency import Api
from tests.dbs import fresh_pg_database

pytestmark = pytest.mark.slow


class Hammer:
    """Clients sending GET /v1/tenants with one key; each answer kept with its send and answer
    times."""

    def __init__(self, url: str, key: str, clients: int = 6) -> None:
        self.url, self.key = url, key
        self.answers: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Hammer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                status = client.get("/v1/tenants").status_code
                with self._lock:
                    self.answers.append((sent, time.monotonic(), status))


def test_a_key_revoked_by_the_cli_is_refused_by_every_served_worker_at_once(
    tmp_path: Path,
) -> None:
    with fresh_pg_database("kvg_keycache") as url:
        engine = sa.create_engine(url)
        keys = ApiKeys(engine)
        keys.create(Role.ADMIN)  # the server needs its schema and an admin; not used here
        victim = keys.create(Role.AUDITOR).api_key
        engine.dispose()
        api = Api(url, tmp_path)
        api.extra_args = ["--workers", "2"]
        api.start()
        try:
            with Hammer(api.url, victim) as hammer:
                time.sleep(3)  # every connection has been answered, through both workers
                key_id = victim.split("_")[2]
                kvguard = str(Path(sys.executable).parent / "kvguard")
                launched = time.monotonic()
                done = subprocess.run(
                    [kvguard, "keys", "revoke", key_id, "--db", url],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                returned = time.monotonic()
                assert done.returncode == 0, done.stderr
                time.sleep(2)
        finally:
            api.stop()
    before = [s for _, answered, s in hammer.answers if answered < launched]
    after = [s for sent, _, s in hammer.answers if sent > returned]
    assert len(before) > 50 and set(before) == {200}, sorted(set(before))
    assert len(after) > 20, "no requests after the revocation returned"
    # 401, and 429 once the key id is over the failure limit: never served.
    assert set(after) <= {401, 429}, sorted(set(after))
    assert not [s for *_, s in hammer.answers if s >= 500]
