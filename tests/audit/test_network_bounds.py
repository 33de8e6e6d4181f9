"""PostgreSQL connections wait a bounded time for a server that stops answering (kvguard/audit/db.py).

Without `connect_timeout`, libpq waits for the server's first answer for as long as the TCP
connection lives: a database host behind a partition that still completes handshakes (a proxy, a
load balancer) or never answers would hang every caller that needs a new connection, the admin
API's request threads and an engine's link thread alike.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from kvguard.audit.db import PG_NETWORK_DEFAULTS, create_engine
from tests.dbs import PG_URL

pytest.importorskip("psycopg", reason="the postgres extra is not installed")


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port whose listener completes handshakes (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def _fails_within(url: str, limit_s: float) -> float:
    """Seconds until connecting to `url` fails; the test fails (and does not hang) past `limit_s`."""
    engine = create_engine(url)
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            engine.connect().close()
            outcome.append(None)
        except BaseException as exc:  # reported to the test thread
            outcome.append(exc)

    started = time.monotonic()
    attempt = threading.Thread(target=connect, daemon=True)  # a hung attempt must not hang pytest
    attempt.start()
    attempt.join(limit_s)
    waited = time.monotonic() - started
    assert not attempt.is_alive(), f"still connecting after {limit_s} s"
    engine.dispose()
    assert outcome and isinstance(outcome[0], sa.exc.OperationalError), outcome
    return waited


def test_a_server_that_never_answers_fails_a_connection_after_the_default_timeout(
    silent_port: int,
) -> None:
    waited = _fails_within(f"postgresql+psycopg://kvguard@127.0.0.1:{silent_port}/x", 15)
    assert waited >= PG_NETWORK_DEFAULTS["connect_timeout"] - 1  # the default, not an error at once


def test_a_timeout_in_the_url_wins_over_the_default(silent_port: int) -> None:
    waited = _fails_within(
        f"postgresql+psycopg://kvguard@127.0.0.1:{silent_port}/x?connect_timeout=2", 4.5
    )
    assert waited >= 1.5


def test_the_bounds_reach_the_driver_and_url_settings_are_kept() -> None:
    url = sa.engine.make_url(PG_URL).update_query_dict({"keepalives_idle": "7"})
    engine = create_engine(url.render_as_string(hide_password=False))
    try:
        with engine.connect() as conn:
            params = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {exc.__class__.__name__}")
    finally:
        engine.dispose()
    assert params["keepalives_idle"] == "7"
    for key, value in PG_NETWORK_DEFAULTS.items():
        if key != "keepalives_idle":
            assert params[key] == str(value), key


def test_a_lock_held_elsewhere_fails_a_writer_after_the_lock_timeout() -> None:
    """A stray session holding a row lock (a head row) must not hang kvguard's writers behind it:
    every connection gets `lock_timeout` (the default, or what the URL's `options` say), so the
    waiting statement fails (the API answers 503) instead of waiting for ever."""
    plain = sa.create_engine(PG_URL)  # the stray session: no kvguard settings
    try:
        with plain.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS kvg_lock_probe (id int PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO kvg_lock_probe VALUES (1) ON CONFLICT DO NOTHING"))
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}: {exc.__class__.__name__}")
    default = create_engine(PG_URL)
    url = sa.engine.make_url(PG_URL).update_query_dict({"options": "-c lock_timeout=300"})
    short = create_engine(url.render_as_string(hide_password=False))
    try:
        with default.connect() as conn:
            assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "15s"
        with plain.connect() as holder:
            holder.execute(sa.text("SELECT id FROM kvg_lock_probe WHERE id = 1 FOR UPDATE"))
            start = time.monotonic()
            with pytest.raises(sa.exc.OperationalError, match="lock timeout"):  # noqa: SIM117
                with short.begin() as conn:
                    conn.execute(sa.text("SELECT id FROM kvg_lock_probe WHERE id = 1 FOR UPDATE"))
            assert time.monotonic() - start < 5
            holder.rollback()
    finally:
        default.dispose()
        short.dispose()
        with plain.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS kvg_lock_probe"))
        plain.dispose()
