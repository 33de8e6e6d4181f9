"""The dashboard's actions: create and disable a tenant, store a policy version, start a purge, revoke an
inference key, sign a checkpoint. Each is a form post that calls the JSON API's own route function
with the `Action` that `kvguard.api.deps.audited` gave it (the same roles, tenant scoping and
`admin.action` ledger entry as the API call), then redirects to the page showing the result
(post/redirect/get).

Every route here is behind `csrf.read_form` (router-wide: module docstring of
`kvguard.api.dashboard.csrf`). Form fields become the API's own request models; a field that fails
their validation is a 422 naming the field (`form.tenant_id: ...`), never echoing the value.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, TypeVar

import anyio.to_thread
from fastapi import APIRouter, Depends, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from pydantic import BaseModel, ValidationError

from kvguard.api.dashboard import csrf
from kvguard.api.dashboard.csrf import FormDep
from kvguard.api.dashboard.render import PREFIX, dashboard_path
from kvguard.api.deps import ADMINS, TENANT_WRITERS, Action, audited
from kvguard.api.purge_schemas import PurgeCreate
from kvguard.api.routes import audit, inference_keys, policies, purges, tenants
from kvguard.policy import parse_policy
from kvguard.policy.loading import Format

router = APIRouter(prefix=PREFIX, include_in_schema=False, dependencies=[Depends(csrf.read_form)])

Model = TypeVar("Model", bound=BaseModel)


def _model(model: type[Model], **fields: Any) -> Model:
    """`model` validated from form fields; its errors as the API reports a body's (422)."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        errors = [
            {"type": e["type"], "loc": ("form", *e["loc"]), "msg": e["msg"]} for e in exc.errors()
        ]
        raise RequestValidationError(errors) from None


def _see(notice: str, *segments: object) -> RedirectResponse:
    """A 303 to the dashboard page of `segments` (each encoded as one path segment), announcing
    `notice` (a code of `render.NOTICES`)."""
    return RedirectResponse(f"{dashboard_path(*segments)}?notice={notice}", status_code=303)


_MAX_INT_DIGITS: Final = 19  # every version number fits a signed 64-bit column


def _int_or_none(fields: dict[str, str], name: str) -> int | None:
    """The whole number in form field `name`, None when it is empty; a 422 naming the field
    otherwise. ASCII digits only: `str.isdigit` also accepts '²' and other digits `int` refuses,
    whose error would quote the value."""
    value = fields.get(name, "").strip()
    if not value:
        return None
    if value.isascii() and value.isdigit() and len(value) <= _MAX_INT_DIGITS:
        return int(value)
    problem = "must be a whole number (digits 0-9)"
    raise RequestValidationError([{"type": "int_parsing", "loc": ("form", name), "msg": problem}])


@router.post("/tenants")
def create_tenant(
    form: FormDep, action: Annotated[Action, audited("tenant.create", *ADMINS)]
) -> RedirectResponse:
    body = _model(
        tenants.TenantCreate,
        tenant_id=form.get("tenant_id", "").strip(),
        display_name=form.get("display_name", "").strip(),
    )
    created = tenants.create_tenant(body, action)
    return _see("tenant-created", "tenants", created.tenant_id)


@router.post("/tenants/{tenant_id}/disable")
def disable_tenant(
    tenant_id: policies.TenantIdPath,
    form: FormDep,
    action: Annotated[Action, audited("tenant.disable", *ADMINS)],
) -> RedirectResponse:
    body = _model(tenants.DisableRequest, reason=form.get("reason", "").strip())
    result = tenants.disable_tenant(tenant_id, body, action)
    return _see("tenant-disabled", "purges", result.purge_job_id)


@router.post("/tenants/{tenant_id}/inference-keys/{key_id}/revoke")
def revoke_inference_key(
    tenant_id: policies.TenantIdPath,
    key_id: inference_keys.KeyIdPath,
    _form: FormDep,
    action: Annotated[Action, audited("inference_key.revoke", *TENANT_WRITERS)],
) -> RedirectResponse:
    inference_keys.revoke_inference_key(tenant_id, key_id, action)
    return _see("key-revoked", "tenants", tenant_id)


@router.post("/policies")
async def store_policy(
    form: FormDep, action: Annotated[Action, audited("policy.put", *ADMINS)]
) -> RedirectResponse:
    """A whole policy document, as YAML or JSON (JSON is read as JSON, so its errors say so)."""
    text = form.get("policy", "")
    fmt: Format = "json" if text.lstrip().startswith("{") else "yaml"
    # Parsed on a worker thread: a large document would hold the event loop for milliseconds.
    policy = await anyio.to_thread.run_sync(lambda: parse_policy(text, "form.policy", fmt=fmt))
    body = _model(
        policies.PolicyPut,
        policy=policy,  # 422 naming each bad field
        reason=form.get("reason", "").strip(),
        expected_version=_int_or_none(form, "expected_version"),
    )
    stored = await policies.put_policy(body, action, Response())
    return _see("policy-stored", "policies", stored.version)


@router.post("/purges")
async def start_purge(
    form: FormDep, action: Annotated[Action, audited("purge.create", *TENANT_WRITERS)]
) -> RedirectResponse:
    body = _model(
        PurgeCreate,
        kind=form.get("kind", ""),
        value=form.get("value", "").strip(),
        tenant_id=form.get("tenant_id", "").strip() or None,
    )
    created = await purges.create_purge(body, action)
    return _see("purge-started", "purges", created.job_id)


@router.post("/ledger/checkpoints")
def sign_checkpoint(
    _form: FormDep, action: Annotated[Action, audited("audit.checkpoint", *ADMINS)]
) -> RedirectResponse:
    audit.sign_checkpoint(action)
    return _see("checkpoint-signed", "ledger")
