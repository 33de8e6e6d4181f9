"""Typed dependencies: the services, the authenticated caller, role checks, tenant scoping and the
audited-action recorder.

Tenant scoping lives here and only here. `Access` is what a route gets: the caller and the set of
tenants it may see (`None`: all). A `tenant_admin` asking for another tenant's object gets 404, the
same answer as for a tenant that does not exist, so a tenant cannot even learn which tenants exist.
Routes never compare roles or tenant ids themselves.

The dependencies that do no I/O are `async def`: FastAPI runs a sync dependency on a worker thread,
one thread hop (and, under load, a wait for the GIL) per dependency per request. Measured on the
2-core VM under `benchmarks/control_load.py`: four hops per read before, one (the route) after.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Final

import anyio.to_thread
import sqlalchemy as sa
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvguard.api.auth import Principal, Role, authenticate_bearer
from kvguard.api.errors import status_for
from kvguard.api.limits import PRINCIPAL_STATE
from kvguard.api.services import Services
from kvguard.audit.events import AuditEvent, DetailValue
from kvguard.errors import (
    NotFoundError,
    PermissionDeniedError,
)

READERS = (Role.ADMIN, Role.AUDITOR, Role.TENANT_ADMIN)
GLOBAL_READERS = (Role.ADMIN, Role.AUDITOR)
ADMINS = (Role.ADMIN,)
TENANT_WRITERS = (Role.ADMIN, Role.TENANT_ADMIN)


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


# Declares the scheme in the OpenAPI document (Swagger UI's "Authorize", generated clients); the
# check itself is `authenticate_bearer`, so `auto_error` is off.
BEARER = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An admin API key: `kvguard keys create --role admin|auditor|tenant_admin`",
)


async def get_principal(
    request: Request,
    services: ServicesDep,
    _declared: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)] = None,
) -> Principal:
    """The caller behind `Authorization: Bearer <key>`: the one the request gate
    (`kvguard.api.limits`) authenticated before the body was read, else checked here (401, or 429
    past the failure limit)."""
    admitted = request.scope.get("state", {}).get(PRINCIPAL_STATE)
    if isinstance(admitted, Principal):
        return admitted
    return await anyio.to_thread.run_sync(
        lambda: authenticate_bearer(
            services.keys,
            services.limiter,
            request.headers.get("authorization"),
            client=_client(request),
            path=request.url.path,
        )
    )


PrincipalDep = Annotated[Principal, Depends(get_principal)]


@dataclass(frozen=True, slots=True)
class Access:
    """The caller and what it may see. Every tenant-scoped read goes through `tenant` / `visible`."""

    principal: Principal
    services: Services

    @property
    def visible(self) -> frozenset[str] | None:
        """Tenant ids the caller may see; None means every tenant."""
        p = self.principal
        return None if p.role is not Role.TENANT_ADMIN else frozenset({p.tenant_id or ""})

    def may_see(self, tenant_id: str | None) -> bool:
        visible = self.visible
        return visible is None or (tenant_id is not None and tenant_id in visible)

    def tenant(self, tenant_id: str) -> str:
        """`tenant_id` if the caller may see it, else NotFoundError (404, as for a missing tenant)."""
        if not self.may_see(tenant_id):
            raise NotFoundError("tenant not found")  # never the id sent (docs/api.md, errors)
        return tenant_id

    def one_tenant_or_all(self, tenant_id: str | None) -> str | None:
        """A filter for reads: the requested tenant (checked), or for a tenant_admin its own."""
        if tenant_id is not None:
            return self.tenant(tenant_id)
        return self.principal.tenant_id if self.principal.role is Role.TENANT_ADMIN else None

    def ledger_tags(self, tenant_id: str | None) -> list[str] | None:
        """The scope tags a ledger read is limited to: the requested tenant's (checked, as
        `one_tenant_or_all`), a tenant_admin's own, or None for every entry."""
        tenant = self.one_tenant_or_all(tenant_id)
        if tenant is not None:
            return self.services.tenant_ledger_tags(tenant)
        return None if self.visible is None else []  # a tenant_admin bound to nothing sees nothing

    def may_see_entry(self, scope_tag: str | None) -> bool:
        """Whether the caller may see a ledger entry carrying `scope_tag`."""
        tags = self.ledger_tags(None)
        return tags is None or (scope_tag is not None and scope_tag in tags)


def require(*roles: Role) -> Any:
    """A dependency giving `Access` to callers holding one of `roles` (403 for the others)."""

    async def dependency(principal: PrincipalDep, services: ServicesDep) -> Access:
        if principal.role not in roles:
            raise PermissionDeniedError(f"role {principal.role.value} may not do this")
        return Access(principal, services)

    return Depends(dependency)


class Action:
    """One audited call. A route that changes state calls `done(conn, ...)` inside its write
    transaction (`services.write()`), so its `admin.action` entry commits with the change; a route
    that only reads (an export) calls `done(None, ...)`. An exception instead records the matching
    failure outcome (see `kvguard.api.actions`). The outbox is drained before the answer is sent."""

    def __init__(self, access: Access, name: str) -> None:
        self.access = access
        self.name = name
        self.tenant_id: str | None = None
        self.delivered = False  # an entry of its own transaction was recorded for this call
        # The route drained the outbox after its last write (the answer then waits for no
        # second drain, each of which is a ledger transaction on the delivery thread).
        self.drained = False

    def done(
        self,
        conn: sa.Connection | None,
        *,
        tenant_id: str | None = None,
        **target: DetailValue,
    ) -> None:
        self.tenant_id = tenant_id or self.tenant_id
        self._record("ok", target, conn)

    def ok_event(self, *, tenant_id: str | None = None, **target: DetailValue) -> AuditEvent:
        """The `ok` entry of this call, for a writer that commits it with the change itself
        (`kvguard.control.publish`): what `done(conn, ...)` would queue."""
        self.tenant_id = tenant_id or self.tenant_id
        return self.access.services.actions.event(
            self.access.principal, self.name, "ok", tenant_id=self.tenant_id, target=target
        )

    def committed(self) -> None:
        """The `ok_event` committed with its change: log it as `done` does. An error after this
        is not the call's outcome (its change stands): no failure entry contradicts the `ok` one
        (found by a review: a read failing after a purge committed recorded `failed` beside it)."""
        self.access.services.actions.log(self.access.principal, self.name, "ok")
        self.delivered = True

    def recorded(self) -> None:
        """The `ok_event` was appended to the ledger itself, in the transaction of what it
        records (`Ledger.checkpoint_recorded`): log it; an error after this is not recorded as
        the call's outcome, and there is nothing of this call in the outbox to drain."""
        self.committed()
        self.delivered = self.drained = True

    def _record(
        self, outcome: str, target: dict[str, DetailValue], conn: sa.Connection | None = None
    ) -> None:
        self.access.services.actions.record(
            self.access.principal,
            self.name,
            outcome,
            tenant_id=self.tenant_id,
            target=target,
            conn=conn,
        )
        self.delivered = conn is None


_OUTCOMES: Final = {403: "denied", 404: "not_found", 409: "conflict", 412: "conflict"}


def _outcome(exc: BaseException) -> str:
    """The ledger outcome of a call that raised `exc`, from the status it is answered with."""
    status = status_for(exc)
    return _OUTCOMES.get(status, "invalid" if status < 500 else "failed")


def audited(name: str, *roles: Role) -> Any:
    """A dependency giving an `Action` to callers holding one of `roles`; authenticated callers
    without the role are refused (403) and the refusal is recorded."""

    async def dependency(principal: PrincipalDep, services: ServicesDep) -> AsyncIterator[Action]:
        action = Action(Access(principal, services), name)
        if principal.role not in roles:
            await anyio.to_thread.run_sync(action._record, "denied", {})
            raise PermissionDeniedError(f"role {principal.role.value} may not {name}")
        try:
            yield action
        except Exception as exc:
            # An exception inside `services.write()` rolled the change back with its `ok` entry:
            # record the failure instead (not for a call whose entry was delivered on its own).
            if not action.delivered:
                await anyio.to_thread.run_sync(action._record, _outcome(exc), {})
            raise
        if not action.drained:
            await services.deliver_async()

    # scope="function": the failure is recorded before the response is sent.
    return Depends(dependency, scope="function")
