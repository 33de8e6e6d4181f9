"""The FastAPI application: routers, error handlers, the request gate, request logging.

`create_app(services)` serves already-opened `Services` (tests, embedding); `kvguard serve` opens them
from `ApiConfig` and closes them at shutdown. Middleware, outermost first: `AccessLog` (one canonical
line per request: method, route, status, principal key id, duration; never headers or bodies),
`errors.ErrorGuard` (answers what no handler took, never re-raises), the dashboard's session layer
(`dashboard.install`: under `/dashboard` only, it turns the session cookie into the bearer header
the gate checks, and answers what escapes a dashboard page itself, as an HTML page with the
dashboard's security headers, so the guard's bare JSON never reaches a browser), `limits.RequestGate` (body limit, NUL check and authentication before the body
is read), then FastAPI's exception handlers (`errors.install`) and routes.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import anyio.to_thread
import structlog
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvguard import __version__
from kvguard.api import dashboard, errors
from kvguard.api.auth import Principal
from kvguard.api.limits import PRINCIPAL_STATE, RequestGate
from kvguard.api.routes import audit, cache, health, inference_keys, policies, purges, tenants
from kvguard.api.services import CONFIG_ENV, ApiConfig, Services
from kvguard.errors import KvguardError
from kvguard.logging import adopt_server_logging, get_logger

_log = get_logger("kvguard.api.access")

DESCRIPTION = """Compliance admin API of kvguard: tenants, policies, purges with erasure certificates,
cache state and the audit ledger. Authenticate with `Authorization: Bearer <API key>`
(`kvguard keys create --role admin|auditor|tenant_admin`)."""

PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})  # plus the schema and its docs (create_app)


class AccessLog:
    """One log line per request, written when the answer has been sent (or the server gave up)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        structlog.contextvars.clear_contextvars()
        start = time.perf_counter()
        status = 0  # no answer started

        async def send_seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        finally:
            principal = scope.get("state", {}).get(PRINCIPAL_STATE)
            _log.info(
                "request",
                method=scope["method"],
                route=getattr(scope.get("route"), "path", "unmatched"),
                status=status,
                key_id=principal.key_id if isinstance(principal, Principal) else None,
                duration_ms=round((time.perf_counter() - start) * 1000, 2),
            )


def app_from_environment() -> FastAPI:
    """The app of one `kvguard serve --workers N` worker process: opens its own `Services` from the
    settings the parent checked (`KVGUARD_API_CONFIG`) and closes them at shutdown."""
    adopt_server_logging()
    config = ApiConfig.from_json(os.environ[CONFIG_ENV])
    try:
        services = Services.open(config)
    except Exception as exc:
        # uvicorn takes only exit status 3 from a worker as "failed to start", and then stops every
        # worker (the parent exits 1, docs/operations.md); any other error is a worker that died,
        # replaced at once, failing again: a restart loop that never exits. A driver's message may
        # quote connection details (G6): only kvguard's own messages are logged.
        message = str(exc) if isinstance(exc, KvguardError) else None
        _startup_log.error("worker cannot start", error_type=type(exc).__name__, error=message)
        raise SystemExit(_STARTUP_FAILURE) from None
    return create_app(services, close_on_shutdown=True, freeze_heap=True)


_STARTUP_FAILURE: Final = 3  # uvicorn.config.STARTUP_FAILURE
_startup_log = get_logger("kvguard.api.app")


def create_app(
    services: Services, *, close_on_shutdown: bool = False, freeze_heap: bool = False
) -> FastAPI:
    """`freeze_heap`: for a server process (`kvguard serve`), never for tests or an embedding
    process: once started, everything allocated so far (modules, the app, the services) moves to
    the collector's permanent generation, which its full collections skip. Without it every full
    collection walked the ~150,000 objects of the imports: 100-150 ms with the event loop and every
    request thread stopped, every 6-8 s under load, which was the read latency's 99th percentile
    (docs/benchmarks.md). Objects allocated at startup that later become cyclic garbage are never
    collected; a server builds them once."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Route handlers run on anyio's worker threads (40 by default). The work is CPU-bound Python
        # behind one GIL: more threads than the pool of connections can use only slow down the
        # thread that holds a row lock, and every writer queues behind it.
        anyio.to_thread.current_default_thread_limiter().total_tokens = (
            services.config.worker_threads
        )
        if freeze_heap:
            gc.collect()
            gc.freeze()
        yield
        if close_on_shutdown:
            services.close()

    app = FastAPI(
        title="kvguard admin API",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        # Starlette would answer `/v1/tenants/` with a redirect built from the request's `Host`
        # header (a poisoned `Location` behind a proxy that passes `Host` through): an unknown
        # path is a 404 with the documented error body; `/dashboard` redirects by a path.
        redirect_slashes=False,
        # No Swagger UI or ReDoc pages: they run third-party scripts (a CDN's, unpinned, with
        # inline script and no CSP) on the dashboard's origin, where any script can read a
        # signed-in admin's pages and post their forms (found by a review). The schema stays at
        # /openapi.json (and in docs/openapi.json) for any OpenAPI viewer.
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    app.state.services = services
    errors.install(app)
    for module in (health, tenants, inference_keys, policies, purges, cache, audit):
        app.include_router(module.router)
    docs = (app.openapi_url, app.docs_url, app.swagger_ui_oauth2_redirect_url, app.redoc_url)
    # add_middleware puts each new one outside the earlier ones.
    app.add_middleware(
        RequestGate,
        services=services,
        max_body_bytes=services.config.max_body_bytes,
        public_paths=PUBLIC_PATHS | {path for path in docs if path},
    )
    dashboard.install(app)  # /dashboard: its session middleware goes outside RequestGate
    app.add_middleware(errors.ErrorGuard)
    app.add_middleware(AccessLog)
    return app
