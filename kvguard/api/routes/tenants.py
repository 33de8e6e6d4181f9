"""`/v1/tenants`: create, list, get, disable."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status
from pydantic import BaseModel, ConfigDict, Field

from kvguard.api.deps import ADMINS, READERS, Access, Action, audited, require
from kvguard.api.errors import ERROR_RESPONSES
from kvguard.api.offload import OneHopRoute
from kvguard.api.routes.policies import edit_tenant, store_policy
from kvguard.api.text import PlainLine, PlainText
from kvguard.control.commands import PurgeKind, PurgeSelector
from kvguard.control.engines import expected_engines
from kvguard.control.tenants import TENANT_ID_PATTERN

router = APIRouter(
    route_class=OneHopRoute, prefix="/v1/tenants", tags=["tenants"], responses=ERROR_RESPONSES
)

TenantIdField = Field(pattern=TENANT_ID_PATTERN, max_length=128)


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant_id: str = TenantIdField
    display_name: PlainLine = Field(default="", max_length=256)


class TenantPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # built from `control.tenants.Tenant`

    tenant_id: str
    display_name: str
    enabled: bool
    created_at: float
    created_by: str
    disabled_at: float | None = None
    disabled_by: str | None = None
    disable_reason: str | None = None


class TenantPage(BaseModel):
    tenants: list[TenantPublic]
    next_after: str | None = Field(description="Pass as `after` for the next page")


class DisableRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: PlainText = Field(min_length=1, max_length=500)


class DisableResult(BaseModel):
    tenant: TenantPublic
    policy_version: int = Field(description="The policy version that sets `enabled: false`")
    purge_job_id: int = Field(description="The tenant purge queued for every engine")


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TenantPublic)
def create_tenant(
    body: TenantCreate, action: Annotated[Action, audited("tenant.create", *ADMINS)]
) -> TenantPublic:
    """Register a tenant (admin). Its policy is the default until one is stored for it."""
    services = action.access.services
    action.tenant_id = body.tenant_id
    with services.write() as conn:
        tenant = services.tenants.create(
            body.tenant_id,
            display_name=body.display_name,
            created_by=action.access.principal.name,
            conn=conn,
        )
        action.done(conn)
    return TenantPublic.model_validate(tenant)


@router.get("", response_model=TenantPage)
def list_tenants(
    access: Annotated[Access, require(*READERS)],
    after: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> TenantPage:
    """Tenants in id order; a tenant_admin sees only its own."""
    found = access.services.tenants.list(only=access.visible, after=after, limit=limit + 1)
    page = found[:limit]
    return TenantPage(
        tenants=[TenantPublic.model_validate(t) for t in page],
        next_after=page[-1].tenant_id if len(found) > limit else None,
    )


@router.get("/{tenant_id}", response_model=TenantPublic)
def get_tenant(tenant_id: str, access: Annotated[Access, require(*READERS)]) -> TenantPublic:
    return TenantPublic.model_validate(access.services.tenants.get(access.tenant(tenant_id)))


@router.post("/{tenant_id}/disable", response_model=DisableResult)
def disable_tenant(
    tenant_id: str,
    body: DisableRequest,
    action: Annotated[Action, audited("tenant.disable", *ADMINS)],
) -> DisableResult:
    """Disable a tenant (admin): new requests are refused (a policy version with `enabled: false`
    that engines and front ends load) and a tenant purge is queued for every engine."""
    services, who = action.access.services, action.access.principal.name
    # The engines the purge waits for, recorded with its request as `POST /v1/purges` records
    # them: without the count, its certificate could leave out a whole engine and still verify.
    # Read before the write transaction (a second pooled connection inside it can deadlock,
    # `routes.purges._submit`); the job is dated at the same instant, so its report waits for
    # exactly these engines, however long the disable then waits for its locks.
    now = services.clock()
    expected = len(
        expected_engines(services.engines.engines(), now, services.config.engine_max_age_s)
    )
    with services.write() as conn:
        # The policy head first: every policy write takes it before `command_head` (and a
        # re-enabling one before the tenant's row), so a disable that took the tenant's row and
        # `command_head` first and the head last deadlocked with any concurrent policy PUT on
        # PostgreSQL (one of them answered 503 after `deadlock_timeout`; found by a review).
        services.policies.lock_head(conn)
        tenant = services.tenants.disable(tenant_id, by=who, reason=body.reason, conn=conn)
        # Only a registered id is recorded: a refusal's entry never carries an arbitrary string
        # from the URL (one over 200 characters would not pass the ledger's G6 check: a 400).
        action.tenant_id = tenant_id
        # The purge's command goes first: engines run commands in order, and the policy's
        # `enabled: false` shreds the tenant's offload-tier domains and quarantines its blocks as a
        # policy change, leaving the purge nothing to find, so the disable's erasure certificate
        # proved no offloaded copy destroyed. Both commit together; front ends refuse the tenant
        # from the commit on.
        job = services.commands.submit_purge(
            PurgeSelector(PurgeKind.TENANT, tenant_id), requested_by=who, conn=conn, created_at=now
        )
        version = store_policy(
            services,
            conn,
            edit_tenant(tenant_id, lambda p: p.model_copy(update={"enabled": False})),
            author=who,
            reason=f"tenant disabled: {body.reason}",
            limits_of=tenant_id,
        ).version
        action.done(conn, policy_version=version, purge_job_id=job, engines_expected=expected)
    return DisableResult(
        tenant=TenantPublic.model_validate(tenant), policy_version=version, purge_job_id=job
    )
