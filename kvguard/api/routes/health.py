"""`/healthz` (the process answers) and `/readyz` (the database takes writes and the ledger head can
be locked). Both are unauthenticated and say nothing about tenants."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from kvguard.api.deps import ServicesDep
from kvguard.audit.db import write_transaction
from kvguard.logging import get_logger

router = APIRouter(tags=["health"])
_log = get_logger("kvguard.api.health")


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Database or ledger not writable"}})
def readyz(services: ServicesDep) -> JSONResponse:
    store = services.ledger.store
    try:
        # A write transaction that locks the ledger head and commits nothing: proves the database
        # accepts writers (not read-only, not locked out) without growing anything.
        with write_transaction(store.engine) as conn:
            size = store.lock_head(conn)
    except SQLAlchemyError as exc:
        _log.warning("not ready", error_type=type(exc).__name__)
        return JSONResponse({"status": "unavailable", "ledger": "not writable"}, status_code=503)
    return JSONResponse({"status": "ready", "ledger_size": size})
