"""The tenant registry for served engines: inference API keys -> tenant ids, in the database.

A key reads `kvg_<key id>_<secret>`; only SHA-256 of the secret is stored. The secret is 32 random
bytes, so a fast hash is enough (slow hashes defend guessable passwords, not 256-bit random keys) and
keeps the per-request check cheap; the comparison is constant-time. Keys are shown once, at creation.
The API key never appears in logs or errors (the log redactor masks the `kvg_` shape as well).

Keys are issued only for tenants in the tenant registry (`kvguard.control.tenants`) that are not
disabled. The check on every request reads the key row, so a revocation holds from the next request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvguard.control.tenants import TenantRegistry
from kvguard.errors import ConfigError, ConflictError, NotFoundError

_KEY_RE = re.compile(r"^kvg_([A-Za-z0-9]{12})_([A-Za-z0-9_-]{43})$")


class _Base(DeclarativeBase):
    metadata = sa.MetaData()


class TenantApiKey(_Base):
    __tablename__ = "tenant_api_keys"

    key_id: Mapped[str] = mapped_column(sa.String(12), primary_key=True)
    secret_sha256: Mapped[bytes] = mapped_column(sa.LargeBinary(32))
    tenant_id: Mapped[str] = mapped_column(sa.String(256), index=True)
    created_at: Mapped[float] = mapped_column(sa.Float)
    revoked: Mapped[bool] = mapped_column(sa.Boolean, default=False)


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
        _Base.metadata.create_all(engine)

    @classmethod
    def open(cls, url: str) -> TenantKeys:
        return cls(sa.create_engine(url))

    def issue(self, tenant_id: str) -> IssuedKey:
        """A new key for a registered, enabled tenant (NotFoundError / ConflictError otherwise)."""
        if not tenant_id or len(tenant_id) > 256:
            raise ConfigError("tenant id must be 1-256 characters")
        tenant = TenantRegistry(self._engine).get(tenant_id)
        if not tenant.enabled:
            raise ConflictError(f"tenant {tenant_id!r} is disabled; no new keys")
        key_id = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        with self._engine.begin() as conn:
            conn.execute(
                sa.insert(TenantApiKey).values(
                    key_id=key_id,
                    secret_sha256=hashlib.sha256(secret.encode()).digest(),
                    tenant_id=tenant_id,
                    created_at=time.time(),
                    revoked=False,
                )
            )
        return IssuedKey(key_id=key_id, tenant_id=tenant_id, api_key=f"kvg_{key_id}_{secret}")

    def revoke(self, key_id: str, *, tenant_id: str | None = None) -> TenantKeyInfo:
        """Revoke a key (idempotent); with `tenant_id`, only that tenant's key. NotFoundError if
        there is no such key (for that tenant)."""
        where = [TenantApiKey.key_id == key_id]
        if tenant_id is not None:
            where.append(TenantApiKey.tenant_id == tenant_id)
        with self._engine.begin() as conn:
            done = conn.execute(sa.update(TenantApiKey).where(*where).values(revoked=True)).rowcount
        if done != 1:
            raise NotFoundError(f"tenant key {key_id!r} not found")
        return self.list(tenant_id, key_id=key_id)[0]

    def list(
        self, tenant_id: str | None = None, *, key_id: str | None = None
    ) -> list[TenantKeyInfo]:
        """Keys (newest first), optionally of one tenant."""
        stmt = sa.select(
            TenantApiKey.key_id,
            TenantApiKey.tenant_id,
            TenantApiKey.created_at,
            TenantApiKey.revoked,
        ).order_by(TenantApiKey.created_at.desc(), TenantApiKey.key_id)
        if tenant_id is not None:
            stmt = stmt.where(TenantApiKey.tenant_id == tenant_id)
        if key_id is not None:
            stmt = stmt.where(TenantApiKey.key_id == key_id)
        with self._engine.connect() as conn:
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
                    TenantApiKey.secret_sha256, TenantApiKey.tenant_id, TenantApiKey.revoked
                ).where(TenantApiKey.key_id == key_id)
            ).first()
        if row is None or row.revoked:
            return None
        if not hmac.compare_digest(row.secret_sha256, hashlib.sha256(secret.encode()).digest()):
            return None
        return str(row.tenant_id)
