"""The dashboard's read-only pages: tenants, policy history with diffs, purges with their certificates,
ledger checkpoints with witness cosignatures, cache state.

Each view reads through the JSON API's own route functions (`kvguard.api.routes.*`), called with the
`Access` that `kvguard.api.deps.require` granted, so a page shows exactly what the caller's key may
read from the API: same roles, same tenant scoping, same 404 for another tenant's object.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from kvguard.api import certificates
from kvguard.api import purge_jobs as jobs
from kvguard.api.audit_schemas import CheckpointPublic
from kvguard.api.dashboard import summaries
from kvguard.api.dashboard.render import PREFIX, Page, viewer
from kvguard.api.deps import GLOBAL_READERS, READERS, Action, audited
from kvguard.api.purge_schemas import PurgeJobPublic
from kvguard.api.routes import audit, cache, inference_keys, policies, purges, tenants
from kvguard.audit import note
from kvguard.audit.witness_client import WitnessEndpoint
from kvguard.control.commands import PurgeKind
from kvguard.errors import NotFoundError

router = APIRouter(prefix=PREFIX, include_in_schema=False, default_response_class=HTMLResponse)

Reader = Annotated[Page, viewer(*READERS)]
GlobalReader = Annotated[Page, viewer(*GLOBAL_READERS)]
_POLICY_PAGE = 10


def _latest_checkpoint(page: Page) -> CheckpointPublic | None:
    try:
        return audit.latest_checkpoint(page.access)
    except NotFoundError:
        return None


@router.get("")
def bare_prefix() -> RedirectResponse:
    """`/dashboard` -> `/dashboard/` by a path, never built from the `Host` header (the app has
    Starlette's trailing-slash redirects off)."""
    return RedirectResponse(f"{PREFIX}/", status_code=307)


@router.get("/")
def overview(page: Reader) -> HTMLResponse:
    recent = purges.list_purges(page.access, tenant_id=None, before=None, limit=5)
    return page.render("overview.html", jobs=recent.jobs, checkpoint=_latest_checkpoint(page))


@router.get("/tenants")
def tenant_list(
    page: Reader, after: Annotated[str | None, Query(max_length=128)] = None
) -> HTMLResponse:
    found = tenants.list_tenants(page.access, after=after, limit=50)
    return page.render("tenants.html", tenants=found.tenants, next_after=found.next_after)


@router.get("/tenants/{tenant_id}")
def tenant_detail(tenant_id: policies.TenantIdPath, page: Reader) -> HTMLResponse:
    access = page.access
    tenant = tenants.get_tenant(tenant_id, access)  # 404 for another tenant's, as in the API
    policy = policies.tenant_policy(tenant_id, access, Response())
    listed = inference_keys.list_inference_keys(tenant_id, access)  # the newest page
    return page.render(
        "tenant.html",
        tenant=tenant,
        policy=policy,
        policy_text=json.dumps(policy.policy.model_dump(mode="json"), indent=2, sort_keys=True),
        keys=listed.keys,
        more_keys=listed.next_after is not None,
        cache_states=cache.cache_state(access, tenant_id),
        jobs=purges.list_purges(access, tenant_id=tenant_id, before=None, limit=10).jobs,
    )


@router.get("/policies")
def policy_history(
    page: GlobalReader, before: Annotated[int | None, Query(ge=1, lt=1 << 62)] = None
) -> HTMLResponse:
    """Versions newest first, `_POLICY_PAGE` at a time (`before`: the oldest one already shown),
    each with its diff from the version before it."""
    access = page.access
    current = policies.current_policy(access, Response())
    latest = current.change.version if current.change else 0
    top = latest if before is None else min(before - 1, latest)
    # The API lists oldest first from `after`; versions are numbered without gaps (the store's head
    # row), so the page ending at `top`, with the version before its oldest, is one window of it.
    window = policies.policy_history(
        access, after=max(0, top - _POLICY_PAGE - 1), limit=_POLICY_PAGE + 1
    )
    window = [c for c in window if c.version <= top]
    rows = []
    for at in range(len(window) - 1, max(len(window) - 1 - _POLICY_PAGE, -1), -1):
        change = window[at]
        previous = window[at - 1].version if at > 0 else 0
        rows.append((change, previous, _text_diff(page, previous, change.version)))
    oldest_shown = rows[-1][0].version if rows else 0
    return page.render(
        "policies.html",
        rows=rows,
        older=oldest_shown if oldest_shown > 1 else None,
        current_version=latest,
        current_text=summaries.policy_text(current.policy),
    )


def _text_diff(page: Page, old: int, new: int) -> list[summaries.DiffLine]:
    before = policies.policy_version(old, page.access).policy
    after = policies.policy_version(new, page.access).policy
    return summaries.text_diff(
        summaries.policy_text(before),
        summaries.policy_text(after),
        old_name=f"version {old}",
        new_name=f"version {new}",
    )


@router.get("/policies/{version}")
def policy_detail(
    version: Annotated[int, Path(ge=0, lt=1 << 62)], page: GlobalReader
) -> HTMLResponse:
    access = page.access
    stored = policies.policy_version(version, access)
    # The version before this one: the first after `version - 2` (numbered without gaps), or the
    # built-in defaults (0) for version 1.
    earlier = (
        policies.policy_history(access, after=max(0, version - 2), limit=1) if version > 1 else []
    )
    previous = earlier[0].version if earlier and earlier[0].version < version else 0
    changes = (
        policies.policy_diff(access, from_version=previous, to_version=version).changes
        if version
        else []
    )
    return page.render(
        "policy.html",
        version=version,
        stored=stored,
        previous=previous,
        changes=changes,
        diff=_text_diff(page, previous, version) if version else [],
        text=summaries.policy_text(stored.policy),
    )


@router.get("/purges")
def purge_list(
    page: Reader,
    tenant_id: Annotated[str | None, Query(max_length=128)] = None,
    before: Annotated[int | None, Query(ge=1, lt=1 << 62)] = None,
) -> HTMLResponse:
    found = purges.list_purges(page.access, tenant_id=tenant_id or None, before=before, limit=20)
    own = page.principal.tenant_id
    return page.render(
        "purges.html",
        jobs=found.jobs,
        next_before=found.next_before,
        tenant_filter=tenant_id or "",
        kinds=[k.value for k in PurgeKind] if own is None else ["session", "tenant"],
        own_tenant=own or "",
    )


@router.get("/purges/{job_id}")
def purge_detail(job_id: purges.JobId, page: Reader) -> HTMLResponse:
    """A job, and whether the certificate it would get now passes the offline verifier."""
    access, services = page.access, page.access.services
    report = jobs.job_report(access, job_id)  # read once: the page and its certificate check
    job = PurgeJobPublic.of(report)
    verification = None
    if job.status is jobs.PurgeStatus.DONE:
        document = certificates.issue(services, report)
        keys = [note.verifier_key_string(v.name, v.public_key) for v in services.ledger.verifiers()]
        verification = summaries.verify(document, keys, services.ledger.origin)
    return page.render(
        "purge.html",
        job=job,
        verification=verification,
        origin=services.ledger.origin,
        log_keys=services.ledger.verifiers(),
    )


@router.get("/purges/{job_id}/certificate", response_class=JSONResponse)
def certificate(
    job_id: purges.JobId, action: Annotated[Action, audited("purge.certificate", *READERS)]
) -> JSONResponse:
    """The certificate download: the API's own route, recorded in the ledger as it is there; only
    from the dashboard's own pages or typed (`session.DashboardSession`, `csrf.first_party`)."""
    return purges.get_certificate(job_id, action)


@router.get("/ledger")
def ledger(
    page: Reader, cursor: Annotated[int | None, Query(ge=0, lt=1 << 62)] = None
) -> HTMLResponse:
    access, services = page.access, page.access.services
    latest = _latest_checkpoint(page)
    witnesses = [WitnessEndpoint.parse(w).verifier for w in services.config.witnesses]
    log_keys = services.ledger.verifiers()
    signers = summaries.checkpoint_signers(latest.note, log_keys, witnesses) if latest else []
    listed = audit.list_checkpoints(access, cursor=cursor, limit=50)
    return page.render(
        "ledger.html",
        latest=latest,
        signers=signers,
        missing=summaries.missing_witnesses(signers, witnesses) if latest else [],
        witnesses=[w.name for w in witnesses],
        log_keys=log_keys,
        origin=services.ledger.origin,
        checkpoints=listed.checkpoints,
        next_cursor=listed.next_cursor,
    )


@router.get("/cache")
def cache_page(page: Reader) -> HTMLResponse:
    engines = cache.engines(page.access) if page.principal.role in GLOBAL_READERS else None
    return page.render("cache.html", states=cache.cache_state(page.access, None), engines=engines)
