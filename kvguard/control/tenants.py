"""The tenant registry: which tenants exist, who created them, and whether they are disabled.

A tenant row is the anchor the admin API scopes everything to (a `tenant_admin` key is bound to one).
Disabling is one-way here (re-enabling is a new decision with its own audit trail, done by policy):
the row keeps who disabled the tenant, when and why. Enforcement is elsewhere: disabling also stores a
policy version with `enabled: false`, which engines and front ends load (`admit` refuses), and queues
a tenant purge.

Rows are never removed (nothing here or in the API deletes one), so an id once read is registered for
good: `require` remembers the ids it found and answers them without a read (the routes that only
need to know a tenant exists: a policy PUT then takes no worker-thread hop for it,
docs/benchmarks.md). What a row says (`enabled`, who disabled it) is always read afresh (`get`).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from kvguard.control.db import ensure_schema, read_connection, write_transaction
from kvguard.control.schema import TenantRow
from kvguard.errors import ConfigError, ConflictError, NotFoundError
from kvguard.isolation.scope import TENANT_ID_PATTERN

__all__ = ["TENANT_ID_PATTERN", "Tenant", "TenantRegistry", "check_tenant_id"]

_TENANT_ID = re.compile(TENANT_ID_PATTERN)


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


_ONE_TENANT = sa.select(TenantRow).where(TenantRow.tenant_id == sa.bindparam("tenant_id"))
# The same row share-locked (PostgreSQL `FOR SHARE`; SQLite's write transactions are serial): a
# write that depends on the tenant's state waits for a concurrent disable to commit, then sees it.
_ONE_TENANT_LOCKED = _ONE_TENANT.with_for_update(read=True)


@functools.cache
def _tenant_page(*, only: bool, after: bool) -> Any:
    """`TenantRegistry.list`'s statement, built once per shape: bind parameters `limit`, `only`
    (a list) and `after`."""
    stmt = sa.select(TenantRow).order_by(TenantRow.tenant_id).limit(sa.bindparam("limit"))
    if only:
        stmt = stmt.where(TenantRow.tenant_id.in_(sa.bindparam("only", expanding=True)))
    if after:
        stmt = stmt.where(TenantRow.tenant_id > sa.bindparam("after"))
    return stmt


class TenantRegistry:
    """Create, read and disable tenants (table `tenants`)."""

    def __init__(self, engine: sa.Engine, *, clock: Callable[[], float] = time.time) -> None:
        self._engine = engine
        self._clock = clock
        # Ids `require` found registered. Only ids read from a committed row enter (never one a
        # caller sent that was not found, so it holds at most the registered tenants), and none
        # leaves: rows are never removed (module docstring). Set `add` and `in` are atomic
        # under the GIL, and a reader that misses a concurrent `add` only reads the row again.
        self._registered: set[str] = set()
        ensure_schema(engine)

    def create(
        self,
        tenant_id: str,
        *,
        display_name: str,
        created_by: str,
        conn: sa.Connection | None = None,
    ) -> Tenant:
        """Register a tenant; with `conn`, inside the caller's write transaction."""
        check_tenant_id(tenant_id)
        row = {
            "tenant_id": tenant_id,
            "display_name": display_name or tenant_id,
            "created_at": self._clock(),
            "created_by": created_by,
        }
        if conn is None:
            with write_transaction(self._engine) as own:
                return self.create(
                    tenant_id, display_name=display_name, created_by=created_by, conn=own
                )
        exists = conn.execute(
            sa.select(TenantRow.tenant_id).where(TenantRow.tenant_id == tenant_id)
        ).first()
        if exists is not None:
            raise ConflictError("the tenant already exists")
        try:
            with conn.begin_nested():
                conn.execute(sa.insert(TenantRow).values(**row))
        except IntegrityError:
            raise ConflictError("the tenant already exists") from None
        return Tenant(**row)  # type: ignore[arg-type]

    def get(
        self, tenant_id: str, *, conn: sa.Connection | None = None, lock: bool = False
    ) -> Tenant:
        """The tenant's row (NotFoundError if unknown). `lock`: share-locked until `conn`'s write
        transaction ends, for a write that must not follow a concurrent disable's (a key issued
        while the tenant is being disabled)."""
        if conn is None:
            with read_connection(self._engine) as own:
                return self.get(tenant_id, conn=own)
        statement = _ONE_TENANT_LOCKED if lock else _ONE_TENANT
        row = conn.execute(statement, {"tenant_id": tenant_id}).first()
        if row is None:
            raise NotFoundError("tenant not found")  # never the id sent back
        return _tenant(row)

    def is_registered(self, tenant_id: str) -> bool:
        """Whether `tenant_id` is known to be registered without a read (`require` found it)."""
        return tenant_id in self._registered

    def require(self, tenant_id: str) -> None:
        """NotFoundError unless `tenant_id` is registered; an id found once is not read again."""
        if tenant_id not in self._registered:
            self.get(tenant_id)
            self._registered.add(tenant_id)

    def list(
        self, *, only: Collection[str] | None = None, after: str | None = None, limit: int = 100
    ) -> list[Tenant]:
        """Tenants in id order; `only` restricts to those ids (the caller's visible set)."""
        stmt = _tenant_page(only=only is not None, after=after is not None)
        params: dict[str, object] = {"limit": limit}
        if only is not None:
            params["only"] = list(only)
        if after is not None:
            params["after"] = after
        with read_connection(self._engine) as conn:
            return [_tenant(r) for r in conn.execute(stmt, params)]

    def disable(
        self, tenant_id: str, *, by: str, reason: str, conn: sa.Connection | None = None
    ) -> Tenant:
        """Disable a tenant; with `conn`, inside the caller's write transaction."""
        if conn is None:
            with write_transaction(self._engine) as own:
                return self.disable(tenant_id, by=by, reason=reason, conn=own)
        done = conn.execute(
            sa.update(TenantRow)
            .where(TenantRow.tenant_id == tenant_id, TenantRow.disabled_at.is_(None))
            .values(disabled_at=self._clock(), disabled_by=by, disable_reason=reason)
        ).rowcount
        tenant = self.get(tenant_id, conn=conn)  # NotFoundError for an unknown tenant
        if done != 1:
            raise ConflictError("the tenant is already disabled")
        return tenant


# Ends the disables of tenants a policy version re-enables, in that version's transaction
# (`kvguard.control.publish`): the registry says enabled again and a later disable is not refused
# as "already disabled". Bind parameter `ids` (a list); a no-op for enabled or unknown ids.
END_DISABLES: Final = (
    sa.update(TenantRow)
    .where(
        TenantRow.tenant_id.in_(sa.bindparam("ids", expanding=True)),
        TenantRow.disabled_at.is_not(None),
    )
    .values(disabled_at=None, disabled_by=None, disable_reason=None)
)


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
