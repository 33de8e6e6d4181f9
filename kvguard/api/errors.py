"""One error body for every failure: `{"error": <code>, "message": <text>, "fields": [...]}`.

`message` names the field that is wrong (`body.policy.retention.ttl_s: ...`) and never echoes the
value sent (it could be a key or a prompt).

A database that cannot be reached, or that dropped the connection (sqlalchemy `OperationalError`,
`InterfaceError` and the other DBAPI errors, raised as they are or as the cause of a kvguard error
such as `PolicyStoreError`), is `503 unavailable` with `Retry-After`: the request can be tried again
later, and its message and log line say nothing of the statement (whose text and parameters could
carry tenant or session ids). Two DBAPI errors are about the input, not the database, and keep their
meaning: a value the database refuses (`DataError`) is 422, a constraint it enforces
(`IntegrityError`) 409.

`ErrorGuard` answers whatever no handler took: the application's outermost middleware (inside only
Starlette's `ServerErrorMiddleware`, which it leaves nothing to do), it answers 500 (503 for a
database error) and does not re-raise, so no server prints a traceback that could quote SQL, request
data or locals. Its log line carries only the exception type.
"""

from __future__ import annotations

from typing import Any, Final

import pydantic
import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvguard.api.auth import TooManyFailuresError
from kvguard.errors import (
    AuthenticationError,
    ConfigError,
    ConflictError,
    FailClosedError,
    KvguardError,
    NotFoundError,
    PermissionDeniedError,
    PolicyValidationError,
    PolicyVersionConflictError,
    PreconditionFailedError,
    PreconditionRequiredError,
)
from kvguard.logging import get_logger
from kvguard.policy.loading import validation_problems

_log = get_logger("kvguard.api")

RETRY_AFTER_S: Final = 5  # `Retry-After` of a 503: a database restart or fail-over takes seconds

# The exception's own class decides first; then a database error in its cause chain; then the
# catch-alls (`_GENERIC`).
_SPECIFIC: Final[list[tuple[type[BaseException], int, str]]] = [
    (TooManyFailuresError, 429, "rate_limited"),
    (AuthenticationError, 401, "unauthenticated"),
    (PermissionDeniedError, 403, "forbidden"),
    (NotFoundError, 404, "not_found"),
    (PreconditionFailedError, 412, "precondition_failed"),
    (PolicyVersionConflictError, 412, "precondition_failed"),
    (PreconditionRequiredError, 428, "precondition_required"),
    (ConflictError, 409, "conflict"),
    (PolicyValidationError, 422, "invalid_policy"),
    (FailClosedError, 503, "unavailable"),
    (ConfigError, 422, "invalid"),
]
_DATABASE: Final[list[tuple[type[BaseException], int, str]]] = [
    (sa.exc.IntegrityError, 409, "conflict"),
    (sa.exc.DataError, 422, "invalid"),
    (sa.exc.DBAPIError, 503, "unavailable"),  # OperationalError, InterfaceError, ...
    (sa.exc.TimeoutError, 503, "unavailable"),  # no pooled connection came in time
    (sa.exc.DisconnectionError, 503, "unavailable"),
]
_GENERIC: Final[list[tuple[type[BaseException], int, str]]] = [
    (ValueError, 422, "invalid"),
    (KvguardError, 400, "bad_request"),
]
_HTTP_CODES: Final = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    422: "invalid",
    429: "rate_limited",
}
_MESSAGES: Final = {500: "internal error", 503: "service unavailable; retry later"}


class FieldProblem(BaseModel):
    field: str = Field(description="Where: `body.policy.retention.ttl_s`, `query.limit`, ...")
    problem: str


class ErrorBody(BaseModel):
    """Every error response has this body."""

    error: str = Field(description="A stable code: unauthenticated, forbidden, not_found, ...")
    message: str = Field(description="What is wrong; names the field, never echoes the value")
    fields: list[FieldProblem] = Field(default_factory=list)


def _doc(description: str) -> dict[str, Any]:
    return {"description": description, "model": ErrorBody}


ERROR_RESPONSES: Final[dict[int | str, dict[str, Any]]] = {
    401: _doc("Missing or invalid API key"),
    403: _doc("The key's role does not allow this"),
    404: _doc("Not found, or not visible to the caller's tenant"),
    409: _doc("Conflicts with stored state"),
    412: _doc("`If-Match` / `expected_version` names a version that is no longer the latest"),
    413: _doc("The request body is over the configured limit (1 MiB by default)"),
    428: _doc("A policy write that re-enables a disabled tenant must send `If-Match`"),
    422: _doc("Invalid input, or input that cannot be stored; `message` names the field"),
    429: _doc("Too many failed authentications from this client or for this key id"),
    503: _doc("Database or ledger unavailable (fail closed); `Retry-After` says when to retry"),
}


class ApiError(HTTPException):
    """An error answered before or outside a route (request gate, body checks), with its code and
    field problems. An HTTPException, so FastAPI passes it through while reading a body."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        fields: list[dict[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, detail=message, headers=headers)
        self.code = code
        self.fields = fields or []


def _first(exc: BaseException, table: list[tuple[type[BaseException], int, str]]) -> Any:
    return next(((s, c) for kind, s, c in table if isinstance(exc, kind)), None)


def _database_cause(exc: BaseException) -> tuple[int, str] | None:
    """The classification of the first database error in `exc`'s cause / context chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _first(current, _DATABASE)
        if found is not None:
            return found  # type: ignore[no-any-return]
        suppressed = current.__suppress_context__
        current = current.__cause__ or (None if suppressed else current.__context__)
    return None


def _classify(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _classify(exc.exceptions[0])  # task groups (streaming) wrap what their task raised
    if isinstance(exc, HTTPException):
        return exc.status_code, getattr(exc, "code", _HTTP_CODES.get(exc.status_code, "error"))
    if isinstance(exc, RequestValidationError):
        return 422, "invalid"
    found = _first(exc, _SPECIFIC) or _database_cause(exc) or _first(exc, _GENERIC)
    return found if found is not None else (500, "internal")


def status_for(exc: BaseException) -> int:
    """The HTTP status `exc` is answered with."""
    return _classify(exc)[0]


def _body(code: str, message: str, fields: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"error": code, "message": message, "fields": fields or []}


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    fields: list[dict[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The documented error body as a response (also an ASGI app, for middleware)."""
    return JSONResponse(_body(code, message, fields), status_code=status, headers=headers)


def response_for(exc: BaseException) -> JSONResponse:
    """The answer to `exc`: its status and code; the exception text only below 500 (kvguard's
    messages name the field and never the value); `Retry-After` on 429 and 503."""
    status, code = _classify(exc)
    headers: dict[str, str] = {}
    fields: list[dict[str, str]] = []
    if isinstance(exc, HTTPException):
        headers.update(exc.headers or {})
        fields = getattr(exc, "fields", [])
        message = str(exc.detail)
    elif isinstance(exc, PolicyValidationError):
        fields = [{"field": f, "problem": p} for f, p in exc.problems]
        message = str(exc)
    elif isinstance(exc, pydantic.ValidationError):  # a model built in a route: never its input
        fields = [{"field": f, "problem": p} for f, p in validation_problems(exc)]
        message = "; ".join(f"{f['field']}: {f['problem']}" for f in fields) or "invalid"
    else:
        message = _MESSAGES.get(status) or str(exc)
    if isinstance(exc, TooManyFailuresError):
        headers["Retry-After"] = str(exc.retry_after_s)
    elif status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if status >= 500:
        _log.error("request failed", status=status, error_type=type(exc).__name__)
    return error_response(status, code, message, fields=fields, headers=headers or None)


def _validation_fields(exc: RequestValidationError) -> list[dict[str, str]]:
    """The fields a body got wrong, by path. A path may hold a member name the client chose (an
    unknown field, a map key); one that reads like a key or free text is not echoed (G6)."""
    fields = []
    for err in exc.errors():
        path = ".".join(_path_part(p) for p in err.get("loc", ()))
        fields.append({"field": path, "problem": str(err.get("msg", "invalid"))})
    return fields


def _path_part(part: object) -> str:
    text = str(part)
    if isinstance(part, str) and (len(text) > 64 or text.startswith("kvg_")):
        return "<member>"
    return text


def install(app: FastAPI) -> None:
    """Exception handlers for everything a route may raise; `ErrorGuard` takes the rest."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = _validation_fields(exc)
        message = "; ".join(f"{f['field']}: {f['problem']}" for f in fields) or "invalid request"
        return error_response(422, "invalid", message, fields=fields)

    # Starlette's HTTPException, not only FastAPI's subclass: routing's 404 and 405 are Starlette's.
    @app.exception_handler(HTTPException)
    @app.exception_handler(KvguardError)
    @app.exception_handler(ValueError)
    @app.exception_handler(sa.exc.SQLAlchemyError)
    async def _known(_request: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)


class TrackedSend:
    """`send`, noting whether the response has started: after that no error answer can be sent."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class ErrorGuard:
    """Outermost middleware: answers any exception that escaped the handlers and the request gate
    (module docstring) and never re-raises it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if (
                tracked.started
            ):  # too late for an answer: the server closes the connection unfinished
                _log.error("response failed", error_type=type(exc).__name__)
                return
            await response_for(exc)(scope, receive, send)
