"""`/v1/tenants/{tenant_id}/inference-keys`: the keys tenants' clients use against `kvguard engine serve`.

An admin manages every tenant's keys, a tenant_admin its own tenant's (another tenant's: 404). A key
is shown once, in the answer to its creation; listings carry ids, dates and state, never the key or
its hash. Revocation is effective on the serving front end's next request. Creating and revoking are
`admin.action` ledger entries like every other change.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status
from pydantic import BaseModel, Field

from kvguard.api.deps import READERS, TENANT_WRITERS, Access, Action, audited, require
from kvguard.api.errors import ERROR_RESPONSES
from kvguard.api.offload import OneHopRoute
from kvguard.control.keys import TenantKeyInfo

router = APIRouter(
    route_class=OneHopRoute,
    prefix="/v1/tenants/{tenant_id}/inference-keys",
    tags=["inference keys"],
    responses=ERROR_RESPONSES,
)
KeyIdPath = Annotated[str, Path(pattern=r"^[0-9a-f]{12}$", description="The key's id")]


class InferenceKeyPublic(BaseModel):
    key_id: str
    tenant_id: str
    created_at: float
    revoked: bool

    @classmethod
    def of(cls, info: TenantKeyInfo) -> InferenceKeyPublic:
        return cls(
            key_id=info.key_id,
            tenant_id=info.tenant_id,
            created_at=info.created_at,
            revoked=info.revoked,
        )


class InferenceKeyCreated(InferenceKeyPublic):
    api_key: str = Field(description="The key itself: shown once, never stored or shown again")


class InferenceKeyList(BaseModel):
    keys: list[InferenceKeyPublic]
    next_after: str | None = Field(
        default=None, description="Pass as `after` for the next page; null on the last page"
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=InferenceKeyCreated)
def create_inference_key(
    tenant_id: str, action: Annotated[Action, audited("inference_key.create", *TENANT_WRITERS)]
) -> InferenceKeyCreated:
    """Issue an inference key for a registered, enabled tenant (disabled: 409)."""
    access, services = action.access, action.access.services
    services.tenants.get(access.tenant(tenant_id))
    action.tenant_id = tenant_id
    with services.write() as conn:
        issued = services.inference_keys.issue(tenant_id, conn=conn)
        (info,) = services.inference_keys.list(tenant_id, key_id=issued.key_id, conn=conn)
        action.done(conn, key_id=issued.key_id)
    return InferenceKeyCreated(**InferenceKeyPublic.of(info).model_dump(), api_key=issued.api_key)


@router.get("", response_model=InferenceKeyList)
def list_inference_keys(
    tenant_id: str,
    access: Annotated[Access, require(*READERS)],
    after: Annotated[
        str | None,
        Query(
            pattern=r"^[0-9a-f]{12}$", description="A key id from the previous page's next_after"
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> InferenceKeyList:
    """The tenant's keys, newest first (no secrets), a page at a time; an `after` that is not one
    of this tenant's keys: 404."""
    access.services.tenants.get(access.tenant(tenant_id))
    found = access.services.inference_keys.list(tenant_id, after=after, limit=limit + 1)
    page = found[:limit]
    return InferenceKeyList(
        keys=[InferenceKeyPublic.of(k) for k in page],
        next_after=page[-1].key_id if len(found) > limit else None,
    )


@router.post("/{key_id}/revoke", response_model=InferenceKeyPublic)
def revoke_inference_key(
    tenant_id: str,
    key_id: KeyIdPath,
    action: Annotated[Action, audited("inference_key.revoke", *TENANT_WRITERS)],
) -> InferenceKeyPublic:
    """Revoke one of the tenant's keys (idempotent); the front end refuses it from its next request."""
    access, services = action.access, action.access.services
    services.tenants.get(access.tenant(tenant_id))
    action.tenant_id = tenant_id
    with services.write() as conn:
        info, revoked_now = services.inference_keys.revoke_once(
            key_id, tenant_id=tenant_id, conn=conn
        )
        if revoked_now:
            action.done(conn, key_id=key_id)
        else:  # a repeated call is recorded as what it was: it did not revoke the key again
            action.done(conn, key_id=key_id, already_revoked=True)
    return InferenceKeyPublic.of(info)
