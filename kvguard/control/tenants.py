"""The tenant registry: which tenants exist, who created them, and whether they are disabled.

A tenant row is the anchor the admin API scopes everything to (a `tenant_admin` key is bound to one).
Disabling is one-way here (re-enabling is a new decision with its own audit trail, done by policy):
the row keeps who disabled the tenant, when and why. Enforcement is elsewhere: disabling also stores a
policy version with `enabled: false`, which engines and front ends load (`admit` refuses), and queues
a tenant purge.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvguard.errors import ConfigError, ConflictError, NotFoundError

# Tenant ids travel in URL paths and file names: no slashes, no spaces, no control characters.
TENANT_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
_TENANT_ID = re.compile(TENANT_ID_PATTERN)


class _Base(DeclarativeBase):
    metadata = sa.MetaData()


class TenantRow(_Base):
    __tablename__ = "tenants"

    tenant_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    display_name: Mapped[str] = mapped_column(sa.String(256))
    created_at: Mapped[float] = mapped_column(sa.Float)
    created_by: Mapped[str] = mapped_column(sa.String(128))
    disabled_at: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    disabled_by: Mapped[str | None] = mapped_column(sa.String(128), nullable=True)
    disable_reason: Mapped[str | None] = mapped_column(sa.String(500), nullable=True)


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    display_name: str
    created_at: float
    created_by: str
    disabled_at: float | None = None
    disabled_by: str | None = None
    disable_reason: str | None = None

    @property
    def enabled(self) -> bool:
        return self.disabled_at is None


def check_tenant_id(tenant_id: str) -> str:
    if not _TENANT_ID.fullmatch(tenant_id):
        raise ConfigError(
            "tenant_id must be 1-128 characters of letters, digits and . _ : @ -, "
            "starting with a letter or digit"
        )
    return tenant_id


class TenantRegistry:
    """Create, read and disable tenants (table `tenants`)."""

    def __init__(self, engine: sa.Engine, *, clock: Callable[[], float] = time.time) -> None:
        self._engine = engine
        self._clock = clock
        _Base.metadata.create_all(engine)

    def create(self, tenant_id: str, *, display_name: str, created_by: str) -> Tenant:
        check_tenant_id(tenant_id)
        row = {
            "tenant_id": tenant_id,
            "display_name": display_name or tenant_id,
            "created_at": self._clock(),
            "created_by": created_by,
        }
        try:
            with self._engine.begin() as conn:
                conn.execute(sa.insert(TenantRow).values(**row))
        except IntegrityError:
            raise ConflictError(f"tenant {tenant_id!r} already exists") from None
        return Tenant(**row)  # type: ignore[arg-type]

    def get(self, tenant_id: str) -> Tenant:
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(TenantRow).where(TenantRow.tenant_id == tenant_id)).first()
        if row is None:
            raise NotFoundError(f"tenant {tenant_id!r} not found")
        return _tenant(row)

    def list(
        self, *, only: Collection[str] | None = None, after: str | None = None, limit: int = 100
    ) -> list[Tenant]:
        """Tenants in id order; `only` restricts to those ids (the caller's visible set)."""
        stmt = sa.select(TenantRow).order_by(TenantRow.tenant_id).limit(limit)
        if only is not None:
            stmt = stmt.where(TenantRow.tenant_id.in_(list(only)))
        if after is not None:
            stmt = stmt.where(TenantRow.tenant_id > after)
        with self._engine.connect() as conn:
            return [_tenant(r) for r in conn.execute(stmt)]

    def disable(self, tenant_id: str, *, by: str, reason: str) -> Tenant:
        with self._engine.begin() as conn:
            done = conn.execute(
                sa.update(TenantRow)
                .where(TenantRow.tenant_id == tenant_id, TenantRow.disabled_at.is_(None))
                .values(disabled_at=self._clock(), disabled_by=by, disable_reason=reason)
            ).rowcount
        tenant = self.get(tenant_id)  # NotFoundError for an unknown tenant
        if done != 1:
            raise ConflictError(f"tenant {tenant_id!r} is already disabled")
        return tenant


def _tenant(row: sa.Row[tuple[TenantRow]] | sa.Row[object]) -> Tenant:
    m = row._mapping
    return Tenant(
        tenant_id=m["tenant_id"],
        display_name=m["display_name"],
        created_at=m["created_at"],
        created_by=m["created_by"],
        disabled_at=m["disabled_at"],
        disabled_by=m["disabled_by"],
        disable_reason=m["disable_reason"],
    )
