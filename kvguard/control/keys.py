"""The one key store: admin API keys (`ApiKeys`) and tenant inference keys (`TenantKeys`).

Both kinds are 32 random bytes (256 bits) behind a key id, shown once at creation and never stored:
the database keeps a fast hash of the secret (inference keys: SHA-256; admin keys: HMAC-SHA256 under a
per-key salt). Slow password hashes defend guessable passwords, not 256-bit random keys, and would
cost more than the request they guard. Every check does the same work whether the key id exists or
not (an unknown id is hashed and compared against a dummy), and the comparison is constant-time. An
API process on PostgreSQL keeps the rows of keys that authenticated in a revocation-coherent cache
(`kvguard.control.key_cache`: a revocation notifies every process, and the revoker waits out the
cache's lease before it returns), so a revocation holds from the next request in every process; a
check that fails in the cache is redone against the database, so a wrong secret costs the same
whether its key id exists or not. Without the cache (SQLite, the CLI) the row is read every time. Admin
keys issued by kvguard 0.1.0 carry an scrypt hash: the first successful check stores their HMAC and
drops the scrypt hash, so each pays the slow hash at most once.

Key shapes: `kvg_adm_<key id>_<secret>` (admin), `kvg_<key id>_<secret>` (inference); the log redactor
masks both. Inference keys are issued only for registered tenants that are not disabled.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

import sqlalchemy as sa

from kvguard.control.db import ensure_schema, open_engine, read_connection, write_transaction
from kvguard.control.key_cache import CHANNEL, CachedKey, KeyCache, settle
from kvguard.control.schema import AdminKeyRow, TenantKeyRow
from kvguard.control.tenants import TenantRegistry, check_tenant_id
from kvguard.errors import ConfigError, ConflictError, NotFoundError
from kvguard.logging import register_secret

_KEY_RE: Final = re.compile(r"^kvg_([A-Za-z0-9]{12})_([A-Za-z0-9_-]{43})$")
_ADMIN_KEY_RE: Final = re.compile(r"^kvg_adm_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_SCRYPT: Final = {"n": 1 << 14, "r": 8, "p": 1, "maxmem": 64 << 20, "dklen": 32}
_DUMMY_HASH: Final = secrets.token_bytes(32)  # compared against when a key id is unknown
_DUMMY_SALT: Final = secrets.token_bytes(16)
_LEGACY_CHECKS: Final = threading.Lock()  # scrypt checks of 0.1.0 keys, one at a time


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


def _admin_hash(secret: str, salt: bytes) -> bytes:
    return hmac.new(salt, secret.encode(), hashlib.sha256).digest()


def _scrypt(secret: str, salt: bytes) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, **_SCRYPT)


def admin_key_id(api_key: str | None) -> str | None:
    """The key id of a well-formed admin key (for per-key failure limiting), else None."""
    match = _ADMIN_KEY_RE.fullmatch(api_key or "")
    return match.group(1) if match else None


class ApiKeys:
    """Issue, revoke and check admin API keys (table `admin_api_keys`)."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        clock: Callable[[], float] = time.time,
        cache: KeyCache | None = None,
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._cache = cache
        self._notifies = engine.dialect.name == "postgresql"
        ensure_schema(engine)

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def create(
        self,
        role: Role,
        *,
        tenant_id: str | None = None,
        label: str = "",
        conn: sa.Connection | None = None,
    ) -> IssuedApiKey:
        """A new key (shown once); with `conn`, inside the caller's write transaction."""
        if (role is Role.TENANT_ADMIN) != (tenant_id is not None):
            raise ConfigError("a tenant_admin key needs --tenant; other roles must not have one")
        if tenant_id is not None:
            check_tenant_id(tenant_id)
        key_id, secret, salt = (
            secrets.token_hex(6),
            secrets.token_urlsafe(32),
            secrets.token_bytes(16),
        )
        row = {
            "key_id": key_id,
            "salt": salt,
            "secret_hash": _admin_hash(secret, salt),
            "role": role.value,
            "tenant_id": tenant_id,
            "label": label[:200],
            "created_at": self._clock(),
        }
        if conn is None:
            with write_transaction(self._engine) as own:
                own.execute(sa.insert(AdminKeyRow).values(**row))
        else:
            conn.execute(sa.insert(AdminKeyRow).values(**row))
        api_key = f"kvg_adm_{key_id}_{secret}"
        register_secret(api_key)
        return IssuedApiKey(Principal(key_id, role, tenant_id), api_key)

    def revoke(self, key_id: str, *, conn: sa.Connection | None = None) -> None:
        """Revoke a key. Alone, it returns once no API process can take the key any more; with
        `conn` it joins the caller's write transaction, and the caller calls `settle()` after its
        commit."""
        if conn is None:
            with write_transaction(self._engine) as own:
                self.revoke(key_id, conn=own)
            self.settle(key_id)
            return
        done = conn.execute(
            sa.update(AdminKeyRow)
            .where(AdminKeyRow.key_id == key_id, AdminKeyRow.revoked_at.is_(None))
            .values(revoked_at=self._clock())
        ).rowcount
        if done != 1:
            raise NotFoundError("no active admin key with that id")
        if self._notifies:  # delivered at commit to every API process's key cache
            conn.execute(sa.select(sa.func.pg_notify(CHANNEL, key_id)))

    def settle(self, key_id: str) -> None:
        """After a revocation of `key_id` committed: return once no API process can still take
        the key from its cache (`kvguard.control.key_cache`, point 4)."""
        if self._cache is not None:
            self._cache.invalidate(key_id)
        if self._notifies:
            settle()

    def cached(self, api_key: str | None) -> Principal | None:
        """The principal of `api_key` if its row is in the cache and the secret matches; None
        otherwise, and the caller then calls `authenticate` (which reads the row). No I/O: the
        admin API calls this on its event loop. The same work for cached and uncached key ids."""
        if self._cache is None:
            return None
        match = _ADMIN_KEY_RE.fullmatch(api_key or "")
        if match is None:
            return None
        key_id, secret = match.groups()
        entry = self._cache.get(key_id)
        salt = entry.salt if entry is not None else _DUMMY_SALT
        stored = entry.secret_hash if entry is not None else _DUMMY_HASH
        if not hmac.compare_digest(_admin_hash(secret, salt), stored) or entry is None:
            return None
        return Principal(key_id, Role(entry.role), entry.tenant_id)

    def authenticate(self, api_key: str | None) -> Principal | None:
        """The principal of a valid, unrevoked key; None for anything else (never raises on bad
        input). The same work for unknown and known key ids (module docstring)."""
        match = _ADMIN_KEY_RE.fullmatch(api_key or "")
        if match is None:
            return None
        key_id, secret = match.groups()
        t = AdminKeyRow
        generation = self._cache.generation if self._cache is not None else 0
        with read_connection(self._engine) as conn:
            row = conn.execute(
                sa.select(
                    t.salt, t.secret_hash, t.secret_scrypt, t.role, t.tenant_id, t.revoked_at
                ).where(t.key_id == key_id)
            ).first()
        if row is not None and row.secret_hash is None and row.secret_scrypt is not None:
            if row.revoked_at is not None:
                # A revoked 0.1.0 key never authenticates again, so its row keeps its scrypt hash
                # for good: checking it made every guess at its id cost ~16 MiB and ~35 ms of
                # CPU, a standing amplifier (found by a review). The ordinary work instead.
                hmac.compare_digest(_admin_hash(secret, _DUMMY_SALT), _DUMMY_HASH)
                return None
            return self._legacy(key_id, secret, row)
        salt = row.salt if row is not None else _DUMMY_SALT
        stored = row.secret_hash if row is not None else _DUMMY_HASH
        if not hmac.compare_digest(_admin_hash(secret, salt), stored) or row is None:
            return None
        if row.revoked_at is not None:
            return None
        if self._cache is not None:
            entry = CachedKey(bytes(row.salt), bytes(row.secret_hash), row.role, row.tenant_id)
            self._cache.put(key_id, entry, generation)
        return Principal(key_id, Role(row.role), row.tenant_id)

    def _legacy(self, key_id: str, secret: str, row: Any) -> Principal | None:
        """A 0.1.0 key: one scrypt check, then its HMAC replaces the scrypt hash. One check at a
        time in this process: a flood of guesses at a live 0.1.0 key id takes one core, not all."""
        with _LEGACY_CHECKS:
            if not hmac.compare_digest(_scrypt(secret, row.salt), row.secret_scrypt):
                return None
        with write_transaction(self._engine) as conn:
            conn.execute(
                sa.update(AdminKeyRow)
                .where(AdminKeyRow.key_id == key_id)
                .values(secret_hash=_admin_hash(secret, row.salt), secret_scrypt=None)
            )
        if row.revoked_at is not None:
            return None
        return Principal(key_id, Role(row.role), row.tenant_id)


@dataclass(frozen=True, slots=True)
class IssuedKey:
    key_id: str
    tenant_id: str
    api_key: str  # shown once; never stored


@dataclass(frozen=True, slots=True)
class TenantKeyInfo:
    """What may be listed about a key: never the key or its hash."""

    key_id: str
    tenant_id: str
    created_at: float
    revoked: bool

    @property
    def created_iso(self) -> str:
        return datetime.fromtimestamp(self.created_at, UTC).isoformat(timespec="seconds")

    def as_dict(self) -> dict[str, str | float | bool]:
        return {**asdict(self), "created": self.created_iso}


class TenantKeys:
    """Issue, revoke and check tenant inference keys."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        ensure_schema(engine)

    @classmethod
    def open(cls, url: str) -> TenantKeys:
        return cls(open_engine(url))

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def issue(self, tenant_id: str, *, conn: sa.Connection | None = None) -> IssuedKey:
        """A new key for a registered, enabled tenant (NotFoundError / ConflictError otherwise);
        with `conn`, inside the caller's write transaction."""
        if not tenant_id or len(tenant_id) > 256:
            raise ConfigError("tenant id must be 1-256 characters")
        if conn is None:
            with write_transaction(self._engine) as own:
                return self.issue(tenant_id, conn=own)
        tenant = TenantRegistry(self._engine).get(tenant_id, conn=conn, lock=True)
        if not tenant.enabled:
            raise ConflictError("the tenant is disabled; no new keys")
        key_id = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        conn.execute(
            sa.insert(TenantKeyRow).values(
                key_id=key_id,
                secret_sha256=hashlib.sha256(secret.encode()).digest(),
                tenant_id=tenant_id,
                created_at=time.time(),
                revoked=False,
            )
        )
        return IssuedKey(key_id=key_id, tenant_id=tenant_id, api_key=f"kvg_{key_id}_{secret}")

    def revoke(
        self, key_id: str, *, tenant_id: str | None = None, conn: sa.Connection | None = None
    ) -> TenantKeyInfo:
        """Revoke a key (idempotent); with `tenant_id`, only that tenant's key. NotFoundError if
        there is no such key (for that tenant). With `conn`, inside the caller's transaction."""
        return self.revoke_once(key_id, tenant_id=tenant_id, conn=conn)[0]

    def revoke_once(
        self, key_id: str, *, tenant_id: str | None = None, conn: sa.Connection | None = None
    ) -> tuple[TenantKeyInfo, bool]:
        """`revoke`, and whether this call revoked the key (False: it was revoked already, and
        the caller's record of the call says so instead of dating the revocation again)."""
        if conn is None:
            with write_transaction(self._engine) as own:
                return self.revoke_once(key_id, tenant_id=tenant_id, conn=own)
        where = [TenantKeyRow.key_id == key_id, sa.not_(TenantKeyRow.revoked)]
        if tenant_id is not None:
            where.append(TenantKeyRow.tenant_id == tenant_id)
        done = conn.execute(sa.update(TenantKeyRow).where(*where).values(revoked=True)).rowcount
        found = self.list(tenant_id, key_id=key_id, conn=conn)
        if not found:
            raise NotFoundError("tenant key not found")
        return found[0], done == 1

    def list(
        self,
        tenant_id: str | None = None,
        *,
        key_id: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        conn: sa.Connection | None = None,
    ) -> list[TenantKeyInfo]:
        """Keys (newest first), optionally of one tenant. `after` (a key id of that tenant) and
        `limit` page through them along `ix_tenant_api_keys_listing`: the keys listed after that
        key. An `after` that is not a key of `tenant_id` raises NotFoundError."""
        if conn is None:
            with self._engine.connect() as own:
                return self.list(tenant_id, key_id=key_id, after=after, limit=limit, conn=own)
        stmt = sa.select(
            TenantKeyRow.key_id,
            TenantKeyRow.tenant_id,
            TenantKeyRow.created_at,
            TenantKeyRow.revoked,
        ).order_by(TenantKeyRow.created_at.desc(), TenantKeyRow.key_id)
        if tenant_id is not None:
            stmt = stmt.where(TenantKeyRow.tenant_id == tenant_id)
        if key_id is not None:
            stmt = stmt.where(TenantKeyRow.key_id == key_id)
        if after is not None:
            cursor = conn.execute(
                sa.select(TenantKeyRow.created_at).where(
                    TenantKeyRow.key_id == after,
                    *([TenantKeyRow.tenant_id == tenant_id] if tenant_id is not None else []),
                )
            ).scalar_one_or_none()
            if cursor is None:
                raise NotFoundError("tenant key not found (after)")
            stmt = stmt.where(
                sa.or_(
                    TenantKeyRow.created_at < cursor,
                    sa.and_(TenantKeyRow.created_at == cursor, TenantKeyRow.key_id > after),
                )
            )
        if limit is not None:
            stmt = stmt.limit(limit)
        return [
            TenantKeyInfo(r.key_id, r.tenant_id, float(r.created_at), bool(r.revoked))
            for r in conn.execute(stmt)
        ]

    def tenant_for(self, api_key: str | None) -> str | None:
        """The tenant of a valid, unrevoked key; None for anything else (never raises on bad input)."""
        match = _KEY_RE.fullmatch(api_key or "")
        if match is None:
            return None
        key_id, secret = match.groups()
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    TenantKeyRow.secret_sha256, TenantKeyRow.tenant_id, TenantKeyRow.revoked
                ).where(TenantKeyRow.key_id == key_id)
            ).first()
        digest = hashlib.sha256(secret.encode()).digest()
        stored = row.secret_sha256 if row is not None else _DUMMY_HASH  # same work either way
        if not hmac.compare_digest(stored, digest) or row is None or row.revoked:
            return None
        return str(row.tenant_id)
