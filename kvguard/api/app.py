"""The FastAPI application: routers, error handlers, request logging.

`create_app(services)` serves already-opened `Services` (tests, embedding); `kvguard serve` opens them
from `ApiConfig` and closes them at shutdown. One canonical log line per request (method, route,
status, principal key id, duration), never headers or bodies.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request, Response

from kvguard import __version__
from kvguard.api import errors
from kvguard.api.routes import audit, cache, health, inference_keys, policies, purges, tenants
from kvguard.api.services import Services
from kvguard.logging import get_logger

_log = get_logger("kvguard.api.access")

DESCRIPTION = """Compliance admin API of kvguard: tenants, policies, purges with erasure certificates,
cache state and the audit ledger. Authenticate with `Authorization: Bearer <API key>`
(`kvguard keys create --role admin|auditor|tenant_admin`)."""


def create_app(services: Services, *, close_on_shutdown: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if close_on_shutdown:
            services.close()

    app = FastAPI(
        title="kvguard admin API",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.services = services
    errors.install(app)
    for module in (health, tenants, inference_keys, policies, purges, cache, audit):
        app.include_router(module.router)

    @app.middleware("http")
    async def access_log(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        structlog.contextvars.clear_contextvars()
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        _log.info(
            "request",
            method=request.method,
            route=getattr(route, "path", "unmatched"),
            status=response.status_code,
            duration_ms=round((time.perf_counter() - start) * 1000, 2),
        )
        return response

    return app
