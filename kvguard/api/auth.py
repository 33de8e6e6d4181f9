"""Roles and keys of the admin API (`kvguard.control.keys` stores them), bearer authentication and
the failed-authentication limiter.

`authenticate_bearer` is the one place a request's key is checked; the request gate
(`kvguard.api.limits`) calls it before any byte of the body is read.

A key that authenticates is always let through, whatever the limiter says. The check is a
constant-work HMAC (`ApiKeys.authenticate`), so refusing a good key saves nothing, and refusing it
would let one guesser behind a shared address (a NAT, a proxy) lock every valid key behind that
address out. A key that does not authenticate is a failure, counted against the client address and,
for a well-formed admin key, against its key id (a guess at one key's secret spread over many
addresses). Past `max_failures` in `window_s` on either count, a failing request is answered 429 with
`Retry-After` instead of 401: guessing a 256-bit secret is hopeless anyway, so the limiter's job is to
make a spray visible and cheap to answer, never to stand between a valid key and the API.

With several API processes (`kvguard serve --workers N`), each counts in its own memory and, while
its own count is under the limit, in the control database too (`SharedFailures`, the
`auth_failures` table, written on failures only), so the limit holds for the whole server, not per
process. Once a process's own count is over the limit it answers 429 without the database: a spray
costs each process at most `max_failures` writes per subject and window. If the database cannot be
written, the process's own count decides.
"""

from __future__ import annotations

import itertools
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from kvguard.control.db import write_transaction
from kvguard.control.keys import ApiKeys, IssuedApiKey, Principal, Role, admin_key_id
from kvguard.control.schema import AuthFailureRow
from kvguard.errors import AuthenticationError
from kvguard.logging import get_logger

__all__ = [
    "ApiKeys",
    "FailureLimiter",
    "IssuedApiKey",
    "Principal",
    "Role",
    "SharedFailures",
    "TooManyFailuresError",
    "authenticate_bearer",
    "bearer_key",
    "cached_bearer",
]

_log = get_logger("kvguard.api.auth")

# Subjects remembered per kind (client addresses, key ids); past it the least recently failed are
# forgotten. Each costs about 290 bytes with 10 failure times (an `array` of doubles; a deque costs
# 1.1 KB, measured with tracemalloc), so a spray of addresses or made-up key ids holds under 10 MiB.
MAX_TRACKED: Final = 16_384


class TooManyFailuresError(AuthenticationError):
    """The client address or the key id has failed too often; `retry_after_s` says how long to
    wait. Only ever raised for a key that did not authenticate."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("too many failed authentications; retry later")
        self.retry_after_s = int(retry_after_s) + 1


class _Windows:
    """Failure times per subject, the last `limit` of each, for at most `max_tracked` subjects."""

    def __init__(self, limit: int, max_tracked: int) -> None:
        self._limit = limit
        self._max_tracked = max_tracked
        self._times: OrderedDict[str, array[float]] = OrderedDict()

    def add(self, subject: str, now: float) -> None:
        times = self._times.get(subject)
        if times is None:
            if len(self._times) >= self._max_tracked:
                self._times.popitem(last=False)
            times = self._times[subject] = array("d")
        else:
            self._times.move_to_end(subject)
        times.append(now)
        if len(times) > self._limit:
            del times[0]

    def __len__(self) -> int:
        return len(self._times)

    def wait(self, subject: str, now: float, window_s: float) -> float:
        """Seconds until `subject` has fewer than `limit` failures in the window (0.0: now)."""
        times = self._times.get(subject)
        if times is None or len(times) < self._limit:
            return 0.0
        return max(0.0, times[0] + window_s - now)  # times[0]: the oldest of the last `limit`


class SharedFailures:
    """Failure counts shared by the API's processes (`auth_failures`): per subject, the failures
    since its window began; a failure after the window has passed starts a new one. One upsert per
    subject, on failures only (module docstring)."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        max_failures: int,
        window_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._calls = itertools.count(1)

    def failed(self, subjects: Sequence[str]) -> float:
        """Count one failure of each subject; seconds until the most limited of them is under the
        limit again (0.0: none is over it)."""
        now = self._clock()
        wait = 0.0
        with write_transaction(self._engine) as conn:
            for subject in subjects:
                failures, start = conn.execute(self._upsert(subject, now)).one()
                if failures > self.max_failures:
                    wait = max(wait, float(start) + self.window_s - now)
            if next(self._calls) % 256 == 0:  # forget windows long past, now and then
                t = AuthFailureRow
                conn.execute(sa.delete(t).where(t.window_start < now - self.window_s))
        return wait

    def _upsert(self, subject: str, now: float) -> Any:
        t = AuthFailureRow.__table__
        dialect = postgresql if self._engine.dialect.name == "postgresql" else sqlite
        stmt = dialect.insert(t).values(subject=subject, window_start=now, failures=1)
        stale = t.c.window_start <= now - self.window_s
        return stmt.on_conflict_do_update(
            index_elements=[t.c.subject],
            set_={
                "failures": sa.case((stale, 1), else_=t.c.failures + 1),
                "window_start": sa.case((stale, now), else_=t.c.window_start),
            },
        ).returning(t.c.failures, t.c.window_start)


class FailureLimiter:
    """Failed authentications per client address and per key id in a sliding window (see the
    module docstring), in this process's memory and, with `shared`, across processes.
    Thread-safe; memory is bounded by `max_tracked` subjects of each kind."""

    def __init__(
        self,
        *,
        max_failures: int = 10,
        window_s: float = 60.0,
        max_tracked: int = MAX_TRACKED,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedFailures | None = None,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._clients = _Windows(max_failures, max_tracked)
        self._key_ids = _Windows(max_failures, max_tracked)
        self._lock = threading.Lock()
        self._shared = shared

    def failure(self, client: str, key_id: str | None = None) -> float:
        """Count a failed authentication; seconds to answer 429 for (0.0: answer 401). The
        process's own count first; the shared one only while that is under the limit."""
        wait = self.retry_after(client, key_id)
        self.failed(client, key_id)  # counted while limited too: a guesser that keeps on trying
        if wait > 0 or self._shared is None:
            return wait
        subjects = [f"addr:{client}"] + ([f"key:{key_id}"] if key_id is not None else [])
        try:
            return self._shared.failed(subjects)
        except SQLAlchemyError as exc:
            _log.warning("shared failure count unavailable", error=type(exc).__name__)
            return 0.0

    def retry_after(self, client: str, key_id: str | None = None) -> float:
        """Seconds before a failing request from `client` (for `key_id`) is answered 401 again
        rather than 429; 0.0 when neither is over the limit."""
        now = self._clock()
        with self._lock:
            wait = self._clients.wait(client, now, self.window_s)
            if key_id is not None:
                wait = max(wait, self._key_ids.wait(key_id, now, self.window_s))
        return wait

    def tracked(self) -> int:
        """How many client addresses and key ids the limiter remembers (at most 2 * max_tracked)."""
        with self._lock:
            return len(self._clients) + len(self._key_ids)

    def failed(self, client: str, key_id: str | None = None) -> None:
        now = self._clock()
        with self._lock:
            self._clients.add(client, now)
            if key_id is not None:
                self._key_ids.add(key_id, now)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header value, else None."""
    scheme, _, value = (authorization or "").partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def cached_bearer(keys: ApiKeys, authorization: str | None) -> Principal | None:
    """The principal behind the header if its key is in the revocation-coherent cache and its
    secret matches (no I/O, no failure counted); None: call `authenticate_bearer`."""
    return keys.cached(bearer_key(authorization))


def authenticate_bearer(
    keys: ApiKeys,
    limiter: FailureLimiter,
    authorization: str | None,
    *,
    client: str,
    path: str = "",
) -> Principal:
    """The principal behind an `Authorization: Bearer <key>` header value. Raises
    AuthenticationError (401), or TooManyFailuresError (429) when the client address or the key id
    is over the failure limit; a key that authenticates is never refused (module docstring)."""
    api_key = bearer_key(authorization)
    principal = keys.authenticate(api_key) if api_key else None
    if principal is not None:
        return principal
    key_id = admin_key_id(api_key)
    wait = limiter.failure(client, key_id)
    # Never the key, not even its key id (a prefix of it): which part was wrong is nobody's business.
    if wait > 0:
        _log.warning("authentication rate limit hit", client=client, path=path)
        raise TooManyFailuresError(wait)
    _log.warning("authentication failed", client=client, path=path)
    raise AuthenticationError("missing, malformed, unknown or revoked API key")
