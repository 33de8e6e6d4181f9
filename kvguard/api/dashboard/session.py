"""The dashboard's browser session: an ASGI middleware between the application's error guard and the
request gate (`kvguard.api.limits.RequestGate`), acting only on paths under `/dashboard`.

**The session is the API key itself, in an HttpOnly cookie, authenticated on every request exactly
like the bearer header.** For each dashboard request the middleware moves the cookie's key into
`Authorization: Bearer`, and the request gate checks it as it checks any API call: the same key
store, the same failed-authentication limiter, the same principal, and a revoked key stops working
at the next click, in every process. The alternative, a signed session token, would need a
server-side signing secret, a second authentication path beside the gate's, and would outlive a
revocation until it expired. The price is that the key travels with each dashboard request, which
the cookie's attributes confine:

- `HttpOnly`: no script can read it (the pages run none, and their CSP forbids any);
- `SameSite=Strict` and `Path=/dashboard`: sent only to the dashboard, only from its own pages;
  never to `/v1`, where the API ignores cookies anyway (the middleware bridges dashboard paths only);
- `Secure` whenever the request came over https (directly, or via `kvguard serve --trusted-proxy`);
- no `Max-Age`: a session cookie, which the browser drops when it closes, and which is never written
  to the profile on disk for later.

The middleware also answers what needs no session (the login form, the stylesheet), checks the
origin of every unsafe request (`kvguard.api.dashboard.csrf`), signs in (the key is checked with
`kvguard.api.auth.authenticate_bearer`, the gate's own function, counted by the same limiter) and
out (with the session's anti-forgery token, as every form), turns the API's JSON errors into HTML
pages (401: back to the login form), answers an exception that escaped a page the way the
application's `ErrorGuard` would (same status, message and log line) but as such a page, and adds
the security headers of every dashboard answer, errors included (a CSP without scripts, no framing,
no caching, no referrer to other sites).
"""

from __future__ import annotations

import functools
import hmac
import json
import re
from collections.abc import Callable
from importlib import resources
from typing import Any, Final
from urllib.parse import parse_qsl

import anyio.to_thread
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvguard.api.auth import TooManyFailuresError, authenticate_bearer
from kvguard.api.dashboard import csrf
from kvguard.api.dashboard.render import LOGIN, LOGOUT, PREFIX, STYLESHEET, anonymous_page
from kvguard.api.errors import TrackedSend, response_for, status_for
from kvguard.api.services import Services
from kvguard.errors import AuthenticationError
from kvguard.logging import get_logger

_log = get_logger("kvguard.api.dashboard")

COOKIE: Final = "kvguard_session"  # over plain http (development), on the dashboard's path
# Over https: a name browsers accept only from this host, Secure, with no Domain and Path=/ (a
# sibling subdomain could plant a Domain cookie of the plain name: the user then browsed as the
# planter, or, beside a bogus one, could never sign in again; found by a review).
SECURE_COOKIE: Final = "__Host-kvguard_session"
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
# What a cookie may hold to be bridged: printable ASCII without separators (an API key is
# `kvg_adm_<hex>_<base64url>`); anything else is no session at all.
_COOKIE_VALUE: Final = re.compile(r"[A-Za-z0-9_.-]{1,256}")
# Pages whose GET records in the audit ledger (the certificate download, an `admin.action` export
# entry): answered only to this origin's pages or a typed address (`csrf.first_party`).
_RECORDS: Final = re.compile(rf"{PREFIX}/purges/[^/]+/certificate/?")
_MAX_LOGIN_BYTES: Final = 4096
_MAX_ERROR_BYTES: Final = 64 * 1024
_CSP: Final = (
    "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS: Final = (
    (b"content-security-policy", _CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    # Not `no-referrer`: under it Chromium sends `Origin: null` on the pages' own form posts, which
    # the origin check must refuse. `same-origin` still tells other sites nothing (tenant ids in URLs).
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)
_TITLES: Final = {
    400: "Bad request",
    403: "Not allowed",
    404: "Not found",
    405: "Not allowed here",
    409: "Conflict",
    412: "Changed meanwhile",
    413: "Too large",
    422: "Invalid input",
    429: "Too many attempts",
    503: "Unavailable",
}


def in_dashboard(path: str) -> bool:
    return path == PREFIX or path.startswith(f"{PREFIX}/")


def _headers(scope: Scope) -> dict[str, str]:
    return {bytes(k).decode("latin-1"): bytes(v).decode("latin-1") for k, v in scope["headers"]}


def _cookie(secure: bool) -> tuple[str, str]:
    """The session cookie's name and path: `__Host-` over https, the plain name over http."""
    return (SECURE_COOKIE, "/") if secure else (COOKIE, PREFIX)


def session_key(headers: dict[str, str], *, secure: bool) -> str | None:
    """The API key in the session cookie, if there is exactly one, well formed (over https only the
    `__Host-` cookie counts). Two are no session: a sibling subdomain can plant a second cookie of
    the plain name on a narrower path, which the browser sends first, and would otherwise lock the
    user into the planter's session."""
    wanted = _cookie(secure)[0]
    found = [
        value
        for name, _, value in (
            p.strip().partition("=") for p in headers.get("cookie", "").split(";")
        )
        if name == wanted
    ]
    return found[0] if len(found) == 1 and _COOKIE_VALUE.fullmatch(found[0]) else None


def set_session(response: Response, api_key: str, *, secure: bool) -> None:
    name, path = _cookie(secure)
    response.set_cookie(name, api_key, path=path, httponly=True, samesite="strict", secure=secure)


def clear_session(response: Response, *, secure: bool) -> None:
    name, path = _cookie(secure)
    response.delete_cookie(name, path=path, httponly=True, samesite="strict", secure=secure)


def error_page(status: int, message: str, fields: list[dict[str, str]] | None = None) -> Response:
    """The HTML page of an error: the API's status and message (which names the field, never the
    value sent), a title for the status."""
    title = _TITLES.get(status, "Error")
    return anonymous_page(
        "error.html",
        status_code=status,
        title=title,
        status=status,
        message=message,
        fields=fields or [],
    )


def _login_page(
    status: int = 200, message: str | None = None, notice: str | None = None, **headers: str
) -> Response:
    response = anonymous_page("login.html", status_code=status, error=message, notice=notice)
    response.headers.update(headers)
    return response


class DashboardSession:
    """The middleware of the module docstring. `services` are the application's (key store and
    failed-authentication limiter for signing in)."""

    def __init__(self, app: ASGIApp, *, services: Services) -> None:
        self.app = app
        self.services = services
        self.stylesheet = (
            resources.files("kvguard.api.dashboard").joinpath("static/dashboard.css").read_bytes()
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not in_dashboard(scope["path"]):
            await self.app(scope, receive, send)
            return
        send = _secured(send)
        secure = scope.get("scheme") == "https"
        tracked = TrackedSend(send)
        try:
            await self._dispatch(scope, receive, tracked, secure)
        except Exception as exc:
            # Answered here, not by the application's `ErrorGuard` outside: its JSON answer would
            # carry none of the security headers. The same status, message and log line as the
            # guard's (`errors.response_for`), as an HTML page with the headers.
            if tracked.started:
                raise  # too late for an answer: the guard logs it and leaves the connection
            await response_for(exc)(scope, receive, _as_html(send, secure))

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send, secure: bool) -> None:
        path, method, headers = scope["path"], scope["method"], _headers(scope)
        if method not in _SAFE_METHODS and not csrf.same_origin(headers):
            await error_page(403, csrf.CROSS_ORIGIN)(scope, receive, send)
            return
        if method in _SAFE_METHODS and not (
            csrf.first_party(headers) if _RECORDS.fullmatch(path) else csrf.isolated(headers)
        ):
            await error_page(403, csrf.CROSS_ORIGIN)(scope, receive, send)
            return
        if path == STYLESHEET:
            response: Response = Response(self.stylesheet, media_type="text/css")
        elif path == LOGIN:
            response = await self._login(scope, receive, method, secure)
        elif path == LOGOUT and method == "POST":
            response = await _logout(receive, headers, secure)
        elif path == LOGOUT:
            response = error_page(405, "sign out with the button")
        else:
            await self._bridge(scope, receive, send, headers, secure)
            return
        await response(scope, receive, send)

    async def _bridge(
        self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str], secure: bool
    ) -> None:
        """Pass the request on with the session's key as its bearer credential, whatever
        `Authorization` the request came with: a browser sends none to these pages itself, and
        one a proxy in front adds (its own Basic or SSO credential) made every click a failed
        sign-in that signed the user out (found by a review)."""
        raw = [(k, v) for k, v in scope["headers"] if k not in (b"cookie", b"authorization")]
        key = session_key(headers, secure=secure)
        if key is None:
            await RedirectResponse(LOGIN, status_code=303)(scope, receive, send)
            return
        raw.append((b"authorization", f"Bearer {key}".encode()))
        scope["headers"] = raw  # in place: the access log outside reads the route and principal
        await self.app(scope, receive, _as_html(send, secure))

    async def _login(self, scope: Scope, receive: Receive, method: str, secure: bool) -> Response:
        if method in _SAFE_METHODS:
            query = dict(parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1")))
            return _login_page(notice=query.get("notice"))
        if method != "POST":
            return error_page(405, "sign in with the form")
        form = await _small_form(receive, _MAX_LOGIN_BYTES)
        if form is None:
            return _login_page(400, "The form could not be read; try again.")
        api_key = form.get("api_key", "").strip()
        refused = await self._refusal(scope, api_key)
        if refused is not None:
            return refused
        response = RedirectResponse(f"{PREFIX}/", status_code=303)
        set_session(response, api_key, secure=secure)
        return response

    async def _refusal(self, scope: Scope, api_key: str) -> Response | None:
        """None when `api_key` authenticates (the request gate's own check and limiter), else the
        answer to the failed sign-in."""
        check = functools.partial(
            authenticate_bearer,
            self.services.keys,
            self.services.limiter,
            f"Bearer {api_key}",
            client=scope["client"][0] if scope.get("client") else "unknown",
            path=scope["path"],
        )
        try:
            principal = await anyio.to_thread.run_sync(check)
        except TooManyFailuresError as exc:
            message = "Too many failed sign-ins from here; wait and try again."
            return _login_page(429, message, **{"Retry-After": str(exc.retry_after_s)})
        except AuthenticationError:
            return _login_page(401, "That key was not accepted (unknown, revoked or mistyped).")
        except Exception as exc:  # the key store is down: 503, as the gate answers
            return error_page(status_for(exc), "sign-in is not possible right now; retry later")
        _log.info("dashboard sign-in", key_id=principal.key_id, role=principal.role.value)
        return None


async def _logout(receive: Receive, headers: dict[str, str], secure: bool) -> Response:
    """Sign out: clear the cookie, if the form carries the session's anti-forgery token (as every
    form does, `kvguard.api.dashboard.csrf`; otherwise any page that got past the origin check could
    end the session). Without a session there is nothing to protect, and the cookie is cleared."""
    key = session_key(headers, secure=secure)
    if key is not None:
        form = await _small_form(receive, _MAX_LOGIN_BYTES)
        sent = (form or {}).get(csrf.FIELD, "")
        if not hmac.compare_digest(sent.encode(), csrf.token(key).encode()):
            return error_page(403, csrf.FORGED)
    response = RedirectResponse(f"{LOGIN}?notice=signed-out", status_code=303)
    clear_session(response, secure=secure)
    return response


async def _small_form(receive: Receive, limit: int) -> dict[str, str] | None:
    """An urlencoded body of at most `limit` bytes, as a dict; None when longer or malformed."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    try:
        return dict(parse_qsl(b"".join(chunks).decode("utf-8"), max_num_fields=8))
    except (UnicodeDecodeError, ValueError):
        return None


def _secured(send: Send) -> Send:
    """`send` with the dashboard's security headers on the answer (module docstring)."""

    async def send_secured(message: Message) -> None:
        if message["type"] == "http.response.start":
            names = {k for k, _ in SECURITY_HEADERS}
            kept = [(k, v) for k, v in message.get("headers", []) if k not in names]
            message = {**message, "headers": [*kept, *SECURITY_HEADERS]}
        await send(message)

    return send_secured


def _as_html(send: Send, secure: bool) -> Send:
    """`send` that turns the API's JSON error answers into HTML pages: 401 (no, or no longer a,
    valid session) into a redirect to the login form that clears the cookie."""
    held: list[Message] = []  # the start of an error answer, until its body is complete
    body: list[bytes] = []
    replaced = False

    async def send_html(message: Message) -> None:
        nonlocal replaced
        if replaced:
            return  # the rest of an error body too long to read whole
        if message["type"] == "http.response.start":
            if int(message["status"]) < 400 or not _is_json(message):
                await send(message)
            else:
                held.append(message)
            return
        if not held:
            await send(message)
            return
        body.append(message.get("body", b""))
        if message.get("more_body", False) and sum(map(len, body)) <= _MAX_ERROR_BYTES:
            return
        replaced = True
        await _replacement(held[0], b"".join(body), secure)(send)

    return send_html


def _is_json(start: Message) -> bool:
    types = [v for k, v in start.get("headers", []) if k == b"content-type"]
    return bool(types) and bytes(types[0]).startswith(b"application/json")


_KEPT_HEADERS: Final = frozenset({b"retry-after", b"connection", b"allow"})


def _replacement(start: Message, body: bytes, secure: bool) -> Callable[[Send], Any]:
    """The HTML answer standing in for a JSON error answer (`start`, `body`)."""
    status = int(start["status"])
    if status == 401:
        response: Response = RedirectResponse(LOGIN, status_code=303)
        clear_session(response, secure=secure)
    else:
        try:
            error = json.loads(body)
            message, fields = str(error["message"]), list(error.get("fields", []))
        except (ValueError, KeyError, TypeError):
            message, fields = "the request failed", []
        response = error_page(status, message, fields)
    kept = [(k, v) for k, v in start.get("headers", []) if k in _KEPT_HEADERS]

    async def answer(send: Send) -> None:
        headers = [*response.raw_headers, *kept]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        await send({"type": "http.response.body", "body": response.body})

    return answer
