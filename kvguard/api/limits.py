"""The request gate: what every request passes before the application reads a byte of its body.

A pure ASGI middleware, inside `kvguard.api.errors.ErrorGuard` and outside FastAPI's routing. In
order:

1. A declared `Content-Length` over `max_body_bytes`: 413, nothing read.
2. A NUL in the path or the query string: 422 (PostgreSQL cannot store NUL in text, and a value
   that cannot be stored is the caller's error, not a 500).
3. `Authorization: Bearer` for every path but the public ones (health probes, the schema and its
   docs): 401, or 429 past the failure limit (`kvguard.api.auth`). A key in the
   revocation-coherent cache (`kvguard.control.key_cache`, PostgreSQL) is checked on the event loop
   (an HMAC, no I/O, no thread hop); any other key, and every wrong secret, against its database
   row on a worker thread. The principal is left in
   `scope["state"]` (`PRINCIPAL_STATE`), where `kvguard.api.deps.get_principal` takes it instead of
   authenticating again. A caller without a key never gets a body read, a route matched or a
   schema validated.
4. The body is passed through as the application reads it, counted: past `max_body_bytes` (a
   chunked body declares no length) reading raises 413, so no more than the limit is ever held (the
   gate keeps what it passed on, to check the whole body at its end). A JSON string holding
   `\\u0000`, a raw NUL or an unpaired surrogate (PostgreSQL text cannot hold NUL, and neither database
   takes an unpaired surrogate) is refused with 422 before the application gets the last chunk.

An answer sent while the request body is not fully read carries `Connection: close`: the server then
stops receiving it instead of reading (and discarding) the rest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any, Final
from urllib.parse import unquote_to_bytes

import anyio
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvguard.api.auth import Principal, authenticate_bearer, cached_bearer
from kvguard.api.errors import ApiError, response_for
from kvguard.api.services import Services
from kvguard.errors import AuthenticationError

PRINCIPAL_STATE: Final = "kvguard_principal"

# JSON escapes that may decode to something unstorable; only a body holding one is parsed here.
_SUSPECT_ESCAPE: Final = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
_UNSTORABLE_CHAR: Final = re.compile("[\x00\ud800-\udfff]")
_UNSTORABLE: Final = "contains a NUL character or an unpaired surrogate, which cannot be stored"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _authorization(scope: Scope) -> str | None:
    """The one `Authorization` header; two or more are refused (401), not resolved by picking
    one: the layers in front of the application and inside it must not disagree on the caller."""
    values = [v for k, v in scope["headers"] if k == b"authorization"]
    if len(values) > 1:
        raise AuthenticationError("send one Authorization header, not several")
    return bytes(values[0]).decode("latin-1") if values else None


def _route_template(scope: Scope) -> str:
    """The route the path matches, as declared (`/v1/tenants/{tenant_id}`), for the failed
    authentication log line: a raw path carries tenant ids and job ids (the access log logs the
    template too). `unmatched` when no route matches."""
    app = scope.get("app")
    for route in getattr(app, "routes", ()):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return str(getattr(route, "path", "unmatched"))
    return "unmatched"


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def _too_large(limit: int) -> ApiError:
    problem = f"over the limit of {limit} bytes"
    return ApiError(
        413,
        "too_large",
        f"body: {problem}",
        fields=[{"field": "body", "problem": problem}],
    )


def _unstorable(where: str) -> ApiError:
    return ApiError(
        422,
        "invalid",
        f"{where}: {_UNSTORABLE}",
        fields=[{"field": where, "problem": _UNSTORABLE}],
    )


def _declared_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    digits = value.strip() if value is not None else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


def _has_unstorable_json(body: bytes) -> bool:
    """Whether `body`, read as JSON, holds a string (key or value) that cannot be stored. A body
    that is not JSON is left to the application, which answers it (422)."""
    if b"\x00" in body:
        return True
    if _SUSPECT_ESCAPE.search(body) is None:
        return False
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return False
    stack: list[Any] = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _UNSTORABLE_CHAR.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _Body:
    """The request body as the application reads it (step 4 of the module docstring)."""

    def __init__(self, receive: Receive, limit: int, *, declared: bool) -> None:
        self._receive = receive
        self._limit = limit
        self._chunks: list[bytes] = []  # at most `limit` bytes, for the check of the whole body
        self.size = 0
        self.complete = not declared

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] != "http.request":
            return message
        chunk: bytes = message.get("body", b"")
        self.size += len(chunk)
        if self.size > self._limit:
            raise _too_large(self._limit)
        self._chunks.append(chunk)
        if not message.get("more_body", False):
            self.complete = True
            body, self._chunks = b"".join(self._chunks), []
            if _has_unstorable_json(body):
                raise _unstorable("body")
        return message


class RequestGate:
    """Body limit, NUL check and authentication before the application runs (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        services: Services,
        max_body_bytes: int,
        public_paths: Collection[str],
    ) -> None:
        self.app = app
        self.services = services
        self.max_body_bytes = max_body_bytes
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _declared_length(scope)
        declared = bool(length) or _header(scope, b"transfer-encoding") is not None
        body = _Body(receive, self.max_body_bytes, declared=declared)
        started = False

        async def send_closing(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not body.complete:  # the rest of the body is not wanted: stop receiving it
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), (b"connection", b"close")],
                    }
            await send(message)

        try:
            if length is not None and length > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            self._check_target(scope)
            if scope["path"] not in self.public_paths:
                # A key in the revocation-coherent cache is checked here on the event loop (an
                # HMAC, no I/O); anything else is checked against the database on a worker thread.
                principal = cached_bearer(self.services.keys, _authorization(scope))
                if principal is None:
                    principal = await anyio.to_thread.run_sync(self._authenticate, scope)
                scope.setdefault("state", {})[PRINCIPAL_STATE] = principal
        except Exception as exc:  # refused (or the key store is down: 503) before the application
            await response_for(exc)(scope, receive, send_closing)
            return
        try:
            await self.app(scope, body, send_closing)
        except ApiError as exc:  # a body read outside a route's exception handling
            if started:
                raise
            await response_for(exc)(scope, receive, send_closing)

    @staticmethod
    def _check_target(scope: Scope) -> None:
        if "\x00" in scope["path"]:
            raise _unstorable("path")
        if b"\x00" in unquote_to_bytes(scope.get("query_string", b"")):
            raise _unstorable("query")

    def _authenticate(self, scope: Scope) -> Principal:
        return authenticate_bearer(
            self.services.keys,
            self.services.limiter,
            _authorization(scope),
            client=_client(scope),
            path=_route_template(scope),
        )
