"""Admin API keys, roles and the failed-authentication limiter.

A key reads `kvg_adm_<key id>_<secret>` (the log redactor masks the `kvg_` shape). It is shown once, at
creation; the database keeps the key id, the role, the bound tenant and an scrypt hash of the secret
(N=2^14, r=8, p=1: about 16 MiB and tens of milliseconds per check, so a stolen database does not give
fast offline guessing even if a key were ever drawn from a weak source). The comparison is
constant-time.

scrypt on every request would cost more than the queries it guards, so a process remembers keys it has
verified for `CACHE_S` seconds, as an HMAC of the secret under a random per-process pepper (the cache
holds nothing a memory dump could replay elsewhere). Revocation is read from the database on every
request, so it takes effect at once in every process.

Failed authentications are counted per client address; past `max_failures` in `window_s` the client
gets 429 until the window moves on, before its key is even looked at.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvguard.control.tenants import check_tenant_id
from kvguard.errors import ConfigError, NotFoundError
from kvguard.logging import register_secret

_KEY_RE: Final = re.compile(r"^kvg_adm_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_SCRYPT: Final = {"n": 1 << 14, "r": 8, "p": 1, "maxmem": 64 << 20, "dklen": 32}
CACHE_S: Final = 300.0


class Role(StrEnum):
    ADMIN = "admin"  # everything
    AUDITOR = "auditor"  # read-only: audit, exports, tenants, policies, jobs, cache state
    TENANT_ADMIN = "tenant_admin"  # one tenant: its policy, sessions, purges, audit, cache state


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key id (recorded as `who` in the ledger), its role and bound tenant."""

    key_id: str
    role: Role
    tenant_id: str | None = None

    @property
    def name(self) -> str:
        return f"key:{self.key_id}"


@dataclass(frozen=True, slots=True)
class IssuedApiKey:
    principal: Principal
    api_key: str  # shown once; never stored


class _Base(DeclarativeBase):
    metadata = sa.MetaData()


class ApiKeyRow(_Base):
    __tablename__ = "admin_api_keys"

    key_id: Mapped[str] = mapped_column(sa.String(12), primary_key=True)
    salt: Mapped[bytes] = mapped_column(sa.LargeBinary(16))
    secret_scrypt: Mapped[bytes] = mapped_column(sa.LargeBinary(32))
    role: Mapped[str] = mapped_column(sa.String(16))
    tenant_id: Mapped[str | None] = mapped_column(sa.String(128), nullable=True)
    label: Mapped[str] = mapped_column(sa.String(200), default="")
    created_at: Mapped[float] = mapped_column(sa.Float)
    revoked_at: Mapped[float | None] = mapped_column(sa.Float, nullable=True)


def _scrypt(secret: str, salt: bytes) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, **_SCRYPT)


class ApiKeys:
    """Issue, revoke and check admin API keys (table `admin_api_keys`)."""

    def __init__(self, engine: sa.Engine, *, clock: Callable[[], float] = time.time) -> None:
        self._engine = engine
        self._clock = clock
        self._pepper = secrets.token_bytes(32)
        self._verified: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        _Base.metadata.create_all(engine)

    def create(self, role: Role, *, tenant_id: str | None = None, label: str = "") -> IssuedApiKey:
        if (role is Role.TENANT_ADMIN) != (tenant_id is not None):
            raise ConfigError("a tenant_admin key needs --tenant; other roles must not have one")
        if tenant_id is not None:
            check_tenant_id(tenant_id)
        key_id, secret, salt = (
            secrets.token_hex(6),
            secrets.token_urlsafe(32),
            secrets.token_bytes(16),
        )
        with self._engine.begin() as conn:
            conn.execute(
                sa.insert(ApiKeyRow).values(
                    key_id=key_id,
                    salt=salt,
                    secret_scrypt=_scrypt(secret, salt),
                    role=role.value,
                    tenant_id=tenant_id,
                    label=label[:200],
                    created_at=self._clock(),
                )
            )
        api_key = f"kvg_adm_{key_id}_{secret}"
        register_secret(api_key)
        return IssuedApiKey(Principal(key_id, role, tenant_id), api_key)

    def revoke(self, key_id: str) -> None:
        with self._engine.begin() as conn:
            done = conn.execute(
                sa.update(ApiKeyRow)
                .where(ApiKeyRow.key_id == key_id, ApiKeyRow.revoked_at.is_(None))
                .values(revoked_at=self._clock())
            ).rowcount
        if done != 1:
            raise NotFoundError(f"no active admin key with id {key_id!r}")

    def authenticate(self, api_key: str | None) -> Principal | None:
        """The principal of a valid, unrevoked key; None for anything else (never raises)."""
        match = _KEY_RE.fullmatch(api_key or "")
        if match is None:
            return None
        key_id, secret = match.groups()
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(ApiKeyRow).where(ApiKeyRow.key_id == key_id)).first()
        if row is None or row.revoked_at is not None:
            return None
        if not self._check(key_id, secret, row.salt, row.secret_scrypt):
            return None
        return Principal(key_id, Role(row.role), row.tenant_id)

    def _check(self, key_id: str, secret: str, salt: bytes, stored: bytes) -> bool:
        tag = hmac.new(self._pepper, secret.encode(), hashlib.sha256).digest()
        now = time.monotonic()
        with self._lock:
            cached = self._verified.get(key_id)
        if cached is not None and cached[1] > now:
            return hmac.compare_digest(cached[0], tag)
        if not hmac.compare_digest(_scrypt(secret, salt), stored):
            return False
        with self._lock:
            self._verified[key_id] = (tag, now + CACHE_S)
        return True


class FailureLimiter:
    """Failed authentications per client in a sliding window (see the module docstring)."""

    def __init__(
        self,
        *,
        max_failures: int = 10,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, client: str) -> float:
        """Seconds the client must wait before trying again (0.0: it may try now)."""
        now = self._clock()
        with self._lock:
            times = self._failures.get(client)
            if not times:
                return 0.0
            while times and times[0] <= now - self.window_s:
                times.popleft()
            if len(times) < self.max_failures:
                return 0.0
            return max(0.0, times[0] + self.window_s - now)

    def failed(self, client: str) -> None:
        with self._lock:
            if len(self._failures) > 100_000:  # bounded memory under a spray of addresses
                self._failures.clear()
            self._failures.setdefault(client, deque()).append(self._clock())
