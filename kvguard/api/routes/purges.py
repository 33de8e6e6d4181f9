"""`/v1/purges`: purge jobs by session, tenant, model or adapter, their status and erasure certificates.

Who may purge what: an admin anything; a tenant_admin the sessions of its own tenant or the whole
tenant (another tenant: 404, a model or adapter: 403); an auditor nothing, but it reads every job and
certificate. A job is a command every engine executes (`kvguard.control.commands`); its
status and certificate are worked out from the acknowledgements and the ledger on every read
(`kvguard.api.purge_jobs`, `kvguard.api.certificates`).
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio.to_thread
import sqlalchemy as sa
from fastapi import APIRouter, Path, Query, status
from fastapi.responses import JSONResponse

from kvguard.api import certificates
from kvguard.api import purge_jobs as jobs
from kvguard.api.deps import READERS, TENANT_WRITERS, Access, Action, audited, require
from kvguard.api.errors import ERROR_RESPONSES
from kvguard.api.offload import OneHopRoute
from kvguard.api.purge_jobs import PurgeStatus
from kvguard.api.purge_schemas import (
    ErasureCertificate,
    PurgeCreate,
    PurgeCreated,
    PurgeJobPage,
    PurgeJobPublic,
)
from kvguard.api.services import Services
from kvguard.audit.certificate import recorded_value, verify_certificate
from kvguard.control.commands import PurgeSelector
from kvguard.control.db import read_connection
from kvguard.control.engines import expected_engines
from kvguard.control.publish import submit_purge
from kvguard.errors import ConflictError, KvguardError, PermissionDeniedError, VerificationError
from kvguard.logging import get_logger

_log = get_logger("kvguard.api.purges")

router = APIRouter(
    route_class=OneHopRoute, prefix="/v1/purges", tags=["purges"], responses=ERROR_RESPONSES
)

JobId = Annotated[int, Path(ge=1, lt=1 << 31, description="The job id `POST /v1/purges` returned")]

CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"description": "The job is not done yet (or ended incomplete)"}
}


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=PurgeCreated)
async def create_purge(
    body: PurgeCreate, action: Annotated[Action, audited("purge.create", *TENANT_WRITERS)]
) -> PurgeCreated:
    """Queue a purge for every engine. Poll `GET /v1/purges/{job_id}` until it is `done`."""
    job_id, expected = await anyio.to_thread.run_sync(_submit, body, action)
    # Nothing is written after this: a drain that fails leaves the entry in the outbox, which the
    # next drain delivers (the answer does not wait for a second try).
    action.drained = True
    try:
        # The request's entry in the ledger, so that the status below can see it; awaited on the
        # event loop, so no request thread sits idle while the outbox drains (on a thread, a purge
        # held one of the eight for the whole drain: docs/benchmarks.md, 2026-11-27).
        await action.access.services.deliver_async()
        report = await anyio.to_thread.run_sync(jobs.job_report, action.access, job_id)
    except (KvguardError, sa.exc.SQLAlchemyError, OSError) as exc:
        # The job and its request entry committed: every engine runs it. An outage now must not
        # answer 503 "retry later", whose retry queues a second purge (found by a review).
        _log.warning("purge queued; its status could not be read", error=type(exc).__name__)
        return PurgeCreated(job_id=job_id, status=PurgeStatus.QUEUED, engines_expected=expected)
    return PurgeCreated(
        job_id=job_id, status=report.status, engines_expected=report.engines_expected
    )


def _submit(body: PurgeCreate, action: Action) -> tuple[int, int]:
    """Check the caller may purge `body`'s target and store the job with its `admin.action`
    entry; returns the job id and the number of engines it waits for."""
    access, services = action.access, action.access.services
    tenant = body.tenant()
    if tenant is None and access.visible is not None:
        raise PermissionDeniedError("a tenant_admin may purge only sessions or its own tenant")
    if tenant is not None:
        services.tenants.require(access.tenant(tenant))  # 404: unknown, or another tenant's
        action.tenant_id = tenant
    # Read before the write transaction: inside it, a second pooled connection would be taken
    # while the command head's row lock is held, and under load every pooled connection can be
    # waiting on that lock (a deadlock until the pool timeout).
    # The job is dated at the same instant (`created_at`): its report waits for the engines live
    # then, exactly those counted here (found by a review: dated after a wait for the command
    # head's lock, an engine counted here could have aged out, and the done job's certificate
    # listed fewer engines than its request entry recorded).
    now = services.clock()
    expected = len(
        expected_engines(services.engines.engines(), now, services.config.engine_max_age_s)
    )
    # The command and its `admin.action` entry commit together (one statement on PostgreSQL:
    # the command head's row lock is never held across a round trip, `kvguard.control.publish`).
    job_id = submit_purge(
        services.commands,
        services.outbox,
        PurgeSelector(body.kind, body.value, tenant),
        requested_by=access.principal.name,
        created_at=now,
        events=lambda job_id: [
            action.ok_event(
                job_id=job_id,
                purge_kind=body.kind.value,
                engines_expected=expected,
                **recorded_value(body.kind.value, body.value),
            )
        ],
    )
    action.committed()
    return job_id, expected


@router.get("", response_model=PurgeJobPage)
def list_purges(
    access: Annotated[Access, require(*READERS)],
    tenant_id: Annotated[str | None, Query(max_length=128)] = None,
    before: Annotated[
        int | None, Query(ge=1, lt=1 << 62, description="A page's next_before")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> PurgeJobPage:
    """Jobs newest first; a tenant_admin sees only its own tenant's. A page costs O(its jobs'
    entries), whatever the ledger holds (`jobs.reports`)."""
    services = access.services
    with read_connection(services.db) as conn:  # the page, the registry, the acknowledgements
        found = jobs.list_jobs(
            services,
            tenant_id=access.one_tenant_or_all(tenant_id),
            before=before,
            limit=limit + 1,
            conn=conn,
        )
        page = found[:limit]
        control = jobs.control_reads(services, page, conn)
    return PurgeJobPage(
        jobs=[PurgeJobPublic.of(r) for r in jobs.reports(services, page, control)],
        next_before=page[-1].job_id if len(found) > limit else None,
    )


@router.get("/{job_id}", response_model=PurgeJobPublic)
def get_purge(job_id: JobId, access: Annotated[Access, require(*READERS)]) -> PurgeJobPublic:
    """One job: status, each engine's progress, block counts."""
    return PurgeJobPublic.of(jobs.job_report(access, job_id))


@router.get(
    "/{job_id}/certificate",
    response_model=ErasureCertificate,
    responses={
        **CONFLICT,
        200: {"description": "The erasure certificate, as a JSON download"},
    },
)
def get_certificate(
    job_id: JobId, action: Annotated[Action, audited("purge.certificate", *READERS)]
) -> JSONResponse:
    """The erasure certificate of a done job (an export: recorded in the ledger). Verify it offline
    with `kvguard verify CERT.json --key VKEY`."""
    access, services = action.access, action.access.services
    job = jobs.get_job(access, job_id)
    action.tenant_id = job.tenant_id
    report = jobs.report(services, job)
    if report.status is not jobs.PurgeStatus.DONE:
        raise ConflictError(f"purge job {job_id} is {report.status.value}: no certificate yet")
    document = certificates.issue(services, report)
    ErasureCertificate.model_validate(document)  # the documented shape, checked before it leaves
    _check_verifies(services, job_id, document)
    action.done(None, job_id=job_id, tree_size=document["evidence"]["tree_size"])
    return JSONResponse(
        document,
        headers={
            "Content-Disposition": f'attachment; filename="erasure-certificate-{job_id}.json"'
        },
    )


def _check_verifies(services: Services, job_id: int, document: dict[str, Any]) -> None:
    """Verify the certificate as an auditor would (this ledger's keys and origin) before it is
    served: one that would fail offline is never answered with 200 (found by a review: a done
    job's certificate listed fewer engines than its request entry recorded). Its job waits:
    409, and the inconsistency is logged (the verifier's message names entries and fields,
    never tenant data)."""
    ledger = services.ledger
    keys = [k.verifier_key() for k in ledger.signing_keys]
    try:
        verify_certificate(document, keys, origin=ledger.origin)
    except VerificationError as exc:
        _log.error("erasure certificate does not verify; not served", job_id=job_id, error=str(exc))
        # Not "yet": a certificate that fails here fails on every call (a purge queued by
        # `kvguard purge` without the salt keyring, whose entry names no tenant tag, say).
        raise ConflictError(
            f"purge job {job_id}: its certificate does not verify against the ledger ({exc}); "
            "no certificate is issued for it"
        ) from None
