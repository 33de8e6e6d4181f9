"""`/healthz` (the process answers) and `/readyz` (the database takes writes, the ledger head can be
locked and ledger delivery keeps up). Both are unauthenticated, so they say nothing about tenants or
the ledger's contents: a status and, when not ready, which of the three failed."""

from __future__ import annotations

from typing import Final

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from kvguard.api.deps import ServicesDep
from kvguard.api.errors import RETRY_AFTER_S
from kvguard.api.offload import OneHopRoute
from kvguard.audit.db import write_transaction
from kvguard.logging import get_logger

router = APIRouter(route_class=OneHopRoute, tags=["health"])
_log = get_logger("kvguard.api.health")

# Ledger events committed in the outbox but not yet in the ledger above which the API reports not
# ready: the drain (every few seconds) has fallen far behind, so the ledger no longer tells what the
# API did until it catches up.
MAX_PENDING_EVENTS: Final = 10_000


def _unavailable(reason: str) -> JSONResponse:
    # `Retry-After` as on every other route's 503 (docs/api.md, "Errors").
    return JSONResponse(
        {"status": "unavailable", "reason": reason},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "Database not writable, or ledger delivery behind"}},
)
def readyz(services: ServicesDep) -> JSONResponse:
    store = services.ledger.store
    try:
        # A write transaction that locks the ledger head and commits nothing: proves the database
        # accepts writers (not read-only, not locked out) without growing anything.
        with write_transaction(store.engine) as conn:
            store.lock_head(conn)
        pending = services.outbox.pending()
    except SQLAlchemyError as exc:
        _log.warning("not ready", error_type=type(exc).__name__)
        return _unavailable("database not writable")
    if pending > MAX_PENDING_EVENTS:
        _log.warning("not ready: ledger delivery behind", pending=pending)
        return _unavailable("ledger delivery behind")
    return JSONResponse({"status": "ready"})
