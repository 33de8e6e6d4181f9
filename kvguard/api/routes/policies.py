"""`/v1/policies` (the whole policy set) and `/v1/tenants/{id}/policy` (one tenant's entry).

Every stored version is announced to engines as a `policy` command, so they switch to it at their
next poll (PostgreSQL: at once, through LISTEN/NOTIFY). A tenant_admin may change its own tenant's
retention, quota, zeroization, audit level, reuse and classification, but not `enabled` (it cannot
re-enable a tenant the admin disabled) and not `groups` (joining a share group exposes other tenants).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, status
from pydantic import BaseModel, ConfigDict, Field

from kvguard.api.auth import Role
from kvguard.api.deps import (
    ADMINS,
    GLOBAL_READERS,
    READERS,
    TENANT_WRITERS,
    Access,
    Action,
    audited,
    require,
)
from kvguard.api.errors import ERROR_RESPONSES
from kvguard.api.services import Services
from kvguard.errors import NotFoundError, PermissionDeniedError, PolicyStoreError
from kvguard.policy import PolicySet, TenantPolicy
from kvguard.policy.store import PolicyVersion

router = APIRouter(tags=["policies"], responses=ERROR_RESPONSES)

ReasonField = Field(min_length=1, max_length=2000, description="Why: kept with the version")


class PolicyChangePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # built from `policy.store.PolicyChange`

    version: int
    author: str
    reason: str
    digest: str
    at: float


class PolicyVersionPublic(BaseModel):
    change: PolicyChangePublic | None = Field(description="None: nothing stored, defaults apply")
    policy: PolicySet


class PolicyPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicySet
    reason: str = ReasonField


class TenantPolicyPublic(BaseModel):
    tenant_id: str
    version: int = Field(description="The policy set version this comes from (0: defaults)")
    explicit: bool = Field(description="False: the set's default policy applies to this tenant")
    policy: TenantPolicy


class TenantPolicyPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: TenantPolicy
    reason: str = ReasonField


class PolicyDiffEntry(BaseModel):
    path: str
    old: Any = None
    new: Any = None


class PolicyDiff(BaseModel):
    from_version: int
    to_version: int
    changes: list[PolicyDiffEntry]


def _public(version: PolicyVersion | None) -> PolicyVersionPublic:
    if version is None:
        return PolicyVersionPublic(change=None, policy=PolicySet())
    return PolicyVersionPublic(
        change=PolicyChangePublic.model_validate(version.change), policy=version.policy
    )


def store_policy(services: Services, policy: PolicySet, *, author: str, reason: str) -> int:
    """Store a new version, record it in the ledger and tell the engines."""
    version = services.policies.put(policy, author=author, reason=reason)
    services.actions.policy_change(services.policies.get(version).change)
    services.commands.submit_policy(version, requested_by=author)
    return version


def store_tenant_policy(
    services: Services,
    tenant_id: str,
    change: Callable[[TenantPolicy], TenantPolicy],
    *,
    author: str,
    reason: str,
) -> int:
    """Store a version whose entry for `tenant_id` is `change(<its current policy>)`."""
    current = services.policies.current()
    policy_set = current.policy if current else PolicySet()
    data = policy_set.model_dump(mode="json")
    data["tenants"][tenant_id] = change(policy_set.policy_for(tenant_id)).model_dump(mode="json")
    return store_policy(services, PolicySet.model_validate(data), author=author, reason=reason)


@router.get("/v1/policies/current", response_model=PolicyVersionPublic)
def current_policy(access: Annotated[Access, require(*GLOBAL_READERS)]) -> PolicyVersionPublic:
    """The policy set engines enforce now."""
    return _public(access.services.policies.current())


@router.put("/v1/policies", status_code=status.HTTP_201_CREATED, response_model=PolicyChangePublic)
def put_policy(
    body: PolicyPut, action: Annotated[Action, audited("policy.put", *ADMINS)]
) -> PolicyChangePublic:
    """Store a new version of the whole policy set (admin)."""
    services = action.access.services
    version = store_policy(
        services, body.policy, author=action.access.principal.name, reason=body.reason
    )
    action.done(policy_version=version)
    return PolicyChangePublic.model_validate(services.policies.get(version).change)


@router.get("/v1/policies/history", response_model=list[PolicyChangePublic])
def policy_history(
    access: Annotated[Access, require(*GLOBAL_READERS)],
) -> list[PolicyChangePublic]:
    """Every version's metadata, oldest first."""
    return [PolicyChangePublic.model_validate(c) for c in access.services.policies.history()]


@router.get("/v1/policies/versions/{version}", response_model=PolicyVersionPublic)
def policy_version(
    version: int, access: Annotated[Access, require(*GLOBAL_READERS)]
) -> PolicyVersionPublic:
    return _public(_get_version(access.services, version))


def _get_version(services: Services, version: int) -> PolicyVersion | None:
    if version == 0:
        return None
    try:
        return services.policies.get(version)
    except PolicyStoreError:
        raise NotFoundError(f"policy version {version} not found") from None


@router.get("/v1/policies/diff", response_model=PolicyDiff)
def policy_diff(
    access: Annotated[Access, require(*GLOBAL_READERS)],
    from_version: Annotated[int, Query(ge=0, lt=1 << 62)],
    to_version: Annotated[int, Query(ge=0, lt=1 << 62)],
) -> PolicyDiff:
    """Field-by-field differences between two versions (0 is the built-in defaults)."""
    old = _public(_get_version(access.services, from_version)).policy
    new = _public(_get_version(access.services, to_version)).policy
    a, b = _flatten(json.loads(old.canonical_json())), _flatten(json.loads(new.canonical_json()))
    changes = [
        PolicyDiffEntry(path=p, old=a.get(p), new=b.get(p))
        for p in sorted(a.keys() | b.keys())
        if a.get(p) != b.get(p) or (p in a) != (p in b)
    ]
    return PolicyDiff(from_version=from_version, to_version=to_version, changes=changes)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


@router.get("/v1/tenants/{tenant_id}/policy", response_model=TenantPolicyPublic)
def tenant_policy(
    tenant_id: str, access: Annotated[Access, require(*READERS)]
) -> TenantPolicyPublic:
    """The policy that applies to one tenant."""
    services = access.services
    services.tenants.get(access.tenant(tenant_id))
    current = services.policies.current()
    policy_set = current.policy if current else PolicySet()
    return TenantPolicyPublic(
        tenant_id=tenant_id,
        version=current.change.version if current else 0,
        explicit=tenant_id in policy_set.tenants,
        policy=policy_set.policy_for(tenant_id),
    )


@router.put(
    "/v1/tenants/{tenant_id}/policy",
    status_code=status.HTTP_201_CREATED,
    response_model=PolicyChangePublic,
)
def put_tenant_policy(
    tenant_id: str,
    body: TenantPolicyPut,
    action: Annotated[Action, audited("tenant.policy.put", *TENANT_WRITERS)],
) -> PolicyChangePublic:
    """Store a new policy set version that changes only this tenant's entry."""
    access, services = action.access, action.access.services
    services.tenants.get(access.tenant(tenant_id))
    action.tenant_id = tenant_id

    def change(old: TenantPolicy) -> TenantPolicy:
        if access.principal.role is Role.TENANT_ADMIN and (
            body.policy.enabled != old.enabled or body.policy.groups != old.groups
        ):
            raise PermissionDeniedError(
                "a tenant_admin may not change `enabled` or `groups`; ask an admin"
            )
        return body.policy

    version = store_tenant_policy(
        services, tenant_id, change, author=access.principal.name, reason=body.reason
    )
    action.done(policy_version=version)
    return PolicyChangePublic.model_validate(services.policies.get(version).change)
