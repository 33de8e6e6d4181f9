"""A revocation-coherent cache of admin API key rows, so that a request needs no key-row read.

Why: every admin API request read its key's row, one database round trip of the three to five a
read makes (docs/benchmarks.md, "Control plane under load"). A plain cache would let a revoked key
through until it expires; this one keeps the guarantee that a revoked key is refused from the next
request after the revocation returns, in every API process (issue 10 item 9, issue 11 item 6).

The protocol (PostgreSQL only; SQLite processes cache nothing and read the row every time):

1. Every change that can end a key (`ApiKeys.revoke`) sends `pg_notify(CHANNEL, key_id)` in its own
   transaction, so the notification is delivered at commit, never for a rolled-back change.
2. Each API process runs one listener thread on a connection of its own that `LISTEN`s on `CHANNEL`
   and drops the named key from the cache when a notification arrives.
3. The lease. Every `PING_S` the listener reads the clock (`sent`), then notifies itself with a
   token of its own on the same channel. PostgreSQL delivers a channel's notifications to a listener
   in commit order, and holds back a notification queued behind a transaction still committing; so
   when the token comes back, every revocation that committed before `sent` has been applied. The
   cache may then answer until `sent + LEASE_S`. Past that (the listener is slow, its connection is
   gone, the database is down) every request reads its key row again, as without a cache.
4. A revocation that committed at time `c` is applied in every process by `c + LEASE_S`: a process
   whose last token was sent before `c` stops using its cache by then, and one whose token was sent
   after `c` applied the revocation before that token came back. So the revoker waits `LEASE_S`
   after its commit before it answers (`settle`); from then on, no process takes the key.
5. A listener that loses its connection empties the cache and the lease at once (notifications sent
   while it was away are lost), and reconnects with back-off.
6. A row read from the database is cached only if no notification was applied since the read began
   (`generation`): a revocation that commits between the read and the insert cannot be overwritten
   by the older row.

Only keys that authenticated are cached, so nobody can fill the cache with made-up key ids. What is
cached is the row's salt and HMAC, never the secret: each request still computes the HMAC of the
secret it presents.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa

from kvguard.logging import get_logger

CHANNEL: Final = "kvguard_admin_keys"
# Measured on the 2-core VM under benchmarks/control_load.py: a token's round trip takes 0.3-3 ms,
# and under full load the listener thread waits for the GIL for up to tens of ms; a lease of 0.5 s
# renewed every 0.1 s rides that out, and is what a revocation waits (an operator's rare command).
PING_S: Final = 0.1
LEASE_S: Final = 0.5
MAX_ENTRIES: Final = 65_536  # past it the cache starts over (only authenticated keys get in)
_RECONNECT_S: Final = (0.2, 0.5, 1.0, 2.0, 5.0)
_log = get_logger("kvguard.control.key_cache")


@dataclass(frozen=True, slots=True)
class CachedKey:
    """What a key check needs from an unrevoked `admin_api_keys` row."""

    salt: bytes
    secret_hash: bytes
    role: str
    tenant_id: str | None


class KeyCache:
    """Key rows by key id, valid while the listener holds a lease (module docstring)."""

    def __init__(self, engine: sa.Engine, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, CachedKey] = {}
        self._generation = 0  # bumped by every invalidation
        self._lease_until = 0.0  # clock value until which the entries may be used
        self._token_prefix = f"lease:{uuid.uuid4().hex}:"
        self._returned: str | None = None  # the last token of ours that came back
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._backend_pid: int | None = None
        self._thread = threading.Thread(target=self._run, name="kvguard-key-cache", daemon=True)
        self.lapses = 0  # times the lease ran out or the connection was lost (tests, diagnostics)

    def start(self) -> KeyCache:
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._drop_all()

    # -- the request path ---------------------------------------------------------------------

    def get(self, key_id: str) -> CachedKey | None:
        """The cached row of `key_id`, or None (not cached, or no valid lease)."""
        if self._clock() >= self._lease_until:
            return None
        return self._entries.get(key_id)

    @property
    def generation(self) -> int:
        return self._generation

    def put(self, key_id: str, entry: CachedKey, read_from: int) -> None:
        """Cache a row read after `generation` was `read_from`; dropped if anything was
        invalidated since (point 6 of the module docstring)."""
        with self._lock:
            if self._generation != read_from:
                return
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[key_id] = entry

    def usable(self) -> bool:
        return self._clock() < self._lease_until

    # -- invalidation -------------------------------------------------------------------------

    def invalidate(self, key_id: str) -> None:
        with self._lock:
            self._generation += 1
            self._entries.pop(key_id, None)

    def invalidate_all(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()

    def _drop_all(self) -> None:
        with self._lock:
            self._generation += 1
            self._lease_until = 0.0
            self._entries.clear()

    # -- the listener thread ------------------------------------------------------------------

    def wait_listening(self, timeout: float) -> bool:
        """Block until the first lease is held (tests); True if it is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._listening.is_set() and self.usable():
                return True
            time.sleep(0.01)
        return False

    @property
    def backend_pid(self) -> int | None:
        """The PostgreSQL backend of the listening connection (tests cut it)."""
        return self._backend_pid

    def _run(self) -> None:
        import psycopg  # noqa: PLC0415 (the postgres extra; only PostgreSQL API processes get here)

        failures = 0
        while not self._stop.is_set():
            try:
                self._listen()
                failures = 0
            except (psycopg.Error, sa.exc.SQLAlchemyError, OSError) as exc:
                self._drop_all()
                self.lapses += 1
                delay = _RECONNECT_S[min(failures, len(_RECONNECT_S) - 1)]
                failures += 1
                _log.warning(
                    "key cache listener lost its connection; every request reads its key row",
                    error=type(exc).__name__,
                    retry_in_s=delay,
                )
                self._stop.wait(delay)

    def _on_notify(self, notify: Any) -> None:
        payload = str(notify.payload)
        if payload.startswith(self._token_prefix):
            self._returned = payload
        elif payload.startswith("lease:"):
            return  # another process's token
        elif payload:
            self.invalidate(payload)
        else:
            self.invalidate_all()  # a change without a key id

    def _listen(self) -> None:
        # A connection of its own, outside the pool (`detach`), in autocommit: LISTEN takes effect
        # at once and nobody else ever gets the connection (kvguard.control.commands does the same).
        raw = self._engine.raw_connection()
        conn: Any = raw.driver_connection  # psycopg.Connection
        raw.detach()
        try:
            conn.autocommit = True
            conn.execute(f"LISTEN {CHANNEL}")
            self._backend_pid = conn.info.backend_pid
            self._drop_all()  # whatever was sent while nobody listened is lost
            self._listening.set()
            count = 0
            while not self._stop.is_set():
                count += 1
                next_ping = self._clock() + PING_S
                self._renew(conn, f"{self._token_prefix}{count}")
                while not self._stop.is_set() and (left := next_ping - self._clock()) > 0:
                    self._pump(conn, left)
        finally:
            self._listening.clear()
            self._backend_pid = None
            self._drop_all()
            # The psycopg connection itself: the pool's close would first try to reset a
            # connection that may be dead, and log that failure with a traceback.
            conn.close()

    def _renew(self, conn: Any, token: str) -> None:
        """Send `token` to ourselves; extend the lease if it comes back within the lease."""
        sent = self._clock()
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, token))
        while self._returned != token and self._clock() < sent + LEASE_S:
            self._pump(conn, sent + LEASE_S - self._clock())
        if self._returned == token:
            with self._lock:
                self._lease_until = max(self._lease_until, sent + LEASE_S)
        else:
            self.lapses += 1

    def _pump(self, conn: Any, timeout: float) -> None:
        """Apply the notifications that arrive within `timeout` s (at least one batch: psycopg
        keeps those received during `execute` and yields them first, in order)."""
        for notify in conn.notifies(timeout=max(0.0, timeout), stop_after=1):
            self._on_notify(notify)


def settle() -> None:
    """After a revocation committed on PostgreSQL: wait until no API process can still take the
    key from its cache (point 4 of the module docstring)."""
    time.sleep(LEASE_S)
