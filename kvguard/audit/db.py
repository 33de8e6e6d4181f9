"""Database engines for the ledger: durability and locking settings, per dialect.

SQLite: WAL journal with `synchronous=FULL` (a commit is on disk when it returns, also across power
loss; `NORMAL` would only survive an application crash), a busy timeout, and every write transaction
opened with `BEGIN IMMEDIATE` so that the head-row read-modify-write can never be interleaved.
pysqlite's own implicit transaction handling is switched off so that these BEGINs are ours.

PostgreSQL: READ COMMITTED, with the head row locked by `SELECT ... FOR UPDATE` in the store; commits
are durable under the server's default `synchronous_commit=on`.

PostgreSQL connections also get bounded network waits (`PG_NETWORK_DEFAULTS`; a key the URL's
query sets wins): a server that stops answering (a partition drops packets rather than refusing)
fails a new connection after `connect_timeout` seconds and an established one after the TCP
keepalive probes or `tcp_user_timeout`, instead of hanging the caller for the kernel's minutes-long
retransmission limits. The API then answers 503 and an engine's link thread retries. Lock waits are
bounded too (`PG_LOCK_TIMEOUT_MS`: `SET lock_timeout` once per new connection, unless the URL's
`options` set one; a SET rather than a startup option, which PgBouncer refuses): a stray session
that holds a head row (a policy head, the ledger head) fails the writers behind it after that long,
answered 503, instead of hanging them and every request queued behind them.

Both hide SQL parameters from exception texts: a failed statement's ids never reach a log.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa

from kvguard.errors import ConfigError, LedgerUnavailableError

_BUSY_TIMEOUT_MS = 30_000
# libpq parameters (seconds, except tcp_user_timeout in milliseconds); see the module docstring.
PG_NETWORK_DEFAULTS: dict[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
# Far above any lock a kvguard writer holds (a ledger append or a drain: milliseconds to a second
# under load), far below a request's patience.
PG_LOCK_TIMEOUT_MS = 15_000
_WRITE = "kvguard_ledger_write"


UNESCAPED_AT: Final = (
    "the database URL's user information holds an unescaped '@' (write it as %40 in the password)"
)


def parse_url(url: str) -> sa.engine.URL:
    """`url` parsed; ConfigError (never the URL: it may hold a password) when it is not one."""
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        raise ConfigError(
            "the database URL is malformed (expected dialect+driver://user@host:port/name, "
            "with a numeric port)"
        ) from None
    if unescaped_at(parsed):
        raise ConfigError(UNESCAPED_AT)
    return parsed


def unescaped_at(url: sa.engine.URL) -> bool:
    """Whether a password held an `@` that was not percent-encoded: the URL parser ends the
    password at the first `@` and takes the rest of it for the host, where a printed URL (masking
    only the password) and the driver's "could not translate host name" would show it."""
    return "@" in (url.host or "")


def missing_sqlite_file(url: sa.engine.URL) -> bool:
    """Whether `url` names an SQLite file that does not exist (SQLite would create it on
    connect): commands that only read or change stored state refuse it instead."""
    path = url.database
    return bool(
        url.get_backend_name() == "sqlite"
        and path
        and path != ":memory:"
        and not path.startswith("file:")
        and not Path(path).is_file()
    )


def create_engine(url: str) -> sa.Engine:
    """An engine for `url` with the ledger's durability and locking settings."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise LedgerUnavailableError("the ledger needs a durable SQLite file, not :memory:")
        _create_private(Path(parsed.database))
        engine = sa.create_engine(
            url, connect_args={"timeout": _BUSY_TIMEOUT_MS / 1000}, hide_parameters=True
        )
        sa.event.listen(engine, "connect", _sqlite_connect)
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    if parsed.get_backend_name() == "postgresql":
        engine = sa.create_engine(
            url,
            connect_args={k: v for k, v in PG_NETWORK_DEFAULTS.items() if k not in parsed.query},
            isolation_level="READ COMMITTED",
            # No ping before every checkout (a round trip per query batch: 11% of the API's
            # samples under load). A connection the server dropped fails its statement once; the
            # pool is then invalidated and refilled, and the caller gets 503 with Retry-After.
            hide_parameters=True,
            # As many connections as the API's worker threads (anyio's 40) may want at once, so
            # requests do not queue for a connection; idle ones beyond 10 are closed.
            pool_size=10,
            max_overflow=30,
        )
        if "lock_timeout" not in str(parsed.query.get("options", "")):
            sa.event.listen(engine, "connect", _pg_lock_timeout)
        return engine
    raise LedgerUnavailableError(f"unsupported ledger database {parsed.get_backend_name()!r}")


def _pg_lock_timeout(dbapi_connection: Any, _record: Any) -> None:
    """`SET lock_timeout` on a new connection, committed (the pool's reset would undo it)."""
    with dbapi_connection.cursor() as cursor:
        cursor.execute(f"SET lock_timeout = {PG_LOCK_TIMEOUT_MS}")
    dbapi_connection.commit()


def _create_private(path: Path) -> None:
    """Create a new SQLite file 0600: it holds the ledger, tenant ids and key hashes. SQLite gives
    its -wal and -shm files the database file's permissions. An existing file is left as it is."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    except OSError:
        return  # a missing directory or a read-only place: SQLite reports it when it opens
    os.close(fd)


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see _sqlite_begin)
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    # Fewer, larger WAL checkpoints and a 64 MiB page cache: measured 0.06-0.41 s -> 0.063-0.069 s
    # per 10,000-entry batch on the 2-core benchmark machine (docs/benchmarks.md).
    cursor.execute("PRAGMA cache_size=-65536")
    cursor.execute("PRAGMA wal_autocheckpoint=20000")
    cursor.close()


def _sqlite_begin(conn: sa.Connection) -> None:
    mode = "IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "DEFERRED"
    conn.exec_driver_sql(f"BEGIN {mode}")


def read_connection(engine: sa.Engine) -> sa.Connection:
    """A connection for reads that need no transaction of their own (each statement reads the
    latest committed state, as READ COMMITTED does anyway). On PostgreSQL it runs in autocommit:
    psycopg then sends no `BEGIN` before the first statement and the pool no `ROLLBACK` when the
    connection is returned, one round trip per statement instead of three (measured on the 2-core
    VM: 0.21 -> 0.14 ms per checkout and query). Not for `SELECT ... FOR UPDATE`, writes, or reads
    that must see one snapshot. SQLite: a plain connection (its `BEGIN` is ours, `_sqlite_begin`)."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn.execution_options(isolation_level="AUTOCOMMIT")
    return conn


@contextmanager
def reading(engine: sa.Engine, conn: sa.Connection | None) -> Iterator[sa.Connection]:
    """`conn` when the caller holds one for several reads (one pool checkout for all of them: a
    checkout and its return cost about as much CPU as a query), else a `read_connection` of
    `engine` for this read alone."""
    if conn is not None:
        yield conn
        return
    with read_connection(engine) as own:
        yield own


@contextmanager
def write_transaction(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A write transaction: `BEGIN IMMEDIATE` on SQLite, plain BEGIN (READ COMMITTED) on PostgreSQL.

    Commits on normal exit (durably, see the module docstring) and rolls back on error.
    """
    with engine.connect() as plain:
        conn = plain.execution_options(**{_WRITE: True})
        with conn.begin():
            yield conn
