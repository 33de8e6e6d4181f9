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
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from kvguard.control.keys import ApiKeys, IssuedApiKey, Principal, Role, admin_key_id
from kvguard.errors import AuthenticationError
from kvguard.logging import get_logger

__all__ = [
    "ApiKeys",
    "FailureLimiter",
    "IssuedApiKey",
    "Principal",
    "Role",
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


class FailureLimiter:
    """Failed authentications per client address and per key id in a sliding window (see the
    module docstring). Thread-safe; memory is bounded by `max_tracked` subjects of each kind."""

    def __init__(
        self,
        *,
        max_failures: int = 10,
        window_s: float = 60.0,
        max_tracked: int = MAX_TRACKED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._clients = _Windows(max_failures, max_tracked)
        self._key_ids = _Windows(max_failures, max_tracked)
        self._lock = threading.Lock()

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
    wait = limiter.retry_after(client, key_id)
    # Counted while limited too: a guesser that keeps on trying stays limited.
    limiter.failed(client, key_id)
    # Never the key, not even its key id (a prefix of it): which part was wrong is nobody's business.
    if wait > 0:
        _log.warning("authentication rate limit hit", client=client, path=path)
        raise TooManyFailuresError(wait)
    _log.warning("authentication failed", client=client, path=path)
    raise AuthenticationError("missing, malformed, unknown or revoked API key")
