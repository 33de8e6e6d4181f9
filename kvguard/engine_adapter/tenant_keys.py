"""The tenant registry for served engines: inference API keys -> tenant ids, in the database.

A key reads `kvg_<key id>_<secret>`; only SHA-256 of the secret is stored. The secret is 32 random
bytes, so a fast hash is enough (slow hashes defend guessable passwords, not 256-bit random keys) and
keeps the per-request check cheap; the comparison is constant-time. Keys are shown once, at creation.
The API key never appears in logs or errors (the log redactor masks the `kvg_` shape as well).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvguard.errors import ConfigError

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


class TenantKeys:
    """Issue, revoke and check tenant inference keys."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        _Base.metadata.create_all(engine)

    @classmethod
    def open(cls, url: str) -> TenantKeys:
        return cls(sa.create_engine(url))

    def issue(self, tenant_id: str) -> IssuedKey:
        if not tenant_id or len(tenant_id) > 256:
            raise ConfigError("tenant id must be 1-256 characters")
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

    def revoke(self, key_id: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(
                sa.update(TenantApiKey).where(TenantApiKey.key_id == key_id).values(revoked=True)
            )

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
