"""One error body for every failure: `{"error": <code>, "message": <text>, "fields": [...]}`.

`message` names the field that is wrong (`body.policy.retention.ttl_s: ...`) and never echoes the
value sent (it could be a key or a prompt). Unexpected exceptions become a bare 500 with no detail;
the log line carries only the exception type.
"""

from __future__ import annotations

from typing import Any, Final

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from kvguard.errors import (
    AuthenticationError,
    ConfigError,
    ConflictError,
    FailClosedError,
    KvguardError,
    NotFoundError,
    PermissionDeniedError,
    PolicyValidationError,
)
from kvguard.logging import get_logger

_log = get_logger("kvguard.api")

_STATUS: Final[list[tuple[type[BaseException], int, str]]] = [
    (AuthenticationError, 401, "unauthenticated"),
    (PermissionDeniedError, 403, "forbidden"),
    (NotFoundError, 404, "not_found"),
    (ConflictError, 409, "conflict"),
    (PolicyValidationError, 422, "invalid_policy"),
    (FailClosedError, 503, "unavailable"),
    (ConfigError, 422, "invalid"),
    (ValueError, 422, "invalid"),
    (KvguardError, 400, "bad_request"),
]


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
    422: _doc("Invalid input; `message` names the field"),
    429: _doc("Too many failed authentications from this client"),
    503: _doc("Database or ledger unavailable (fail closed)"),
}


def status_for(exc: BaseException) -> int:
    """The HTTP status the handlers below answer `exc` with."""
    if isinstance(exc, HTTPException):
        return exc.status_code
    if isinstance(exc, RequestValidationError):
        return 422
    return _classify(exc)[0]


def _classify(exc: BaseException) -> tuple[int, str]:
    for kind, status, code in _STATUS:
        if isinstance(exc, kind):
            return status, code
    return 500, "internal"


def _body(code: str, message: str, fields: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"error": code, "message": message, "fields": fields or []}


def _validation_fields(exc: RequestValidationError) -> list[dict[str, str]]:
    fields = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err.get("loc", ()))
        fields.append({"field": path, "problem": str(err.get("msg", "invalid"))})
    return fields


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = _validation_fields(exc)
        message = "; ".join(f"{f['field']}: {f['problem']}" for f in fields) or "invalid request"
        return JSONResponse(_body("invalid", message, fields), status_code=422)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        code = {401: "unauthenticated", 403: "forbidden", 404: "not_found", 429: "rate_limited"}
        return JSONResponse(
            _body(code.get(exc.status_code, "error"), str(exc.detail)),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(KvguardError)
    @app.exception_handler(ValueError)
    async def _known(_request: Request, exc: Exception) -> JSONResponse:
        status, code = _classify(exc)
        fields = []
        if isinstance(exc, PolicyValidationError):
            fields = [{"field": f, "problem": p} for f, p in getattr(exc, "problems", [])]
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status >= 500:
            _log.error("request failed", error_type=type(exc).__name__)
            return JSONResponse(_body(code, "service unavailable"), status_code=status)
        return JSONResponse(_body(code, str(exc), fields), status_code=status, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        _log.error("unexpected error", error_type=type(exc).__name__)
        return JSONResponse(_body("internal", "internal error"), status_code=500)
