"""Cross-site request forgery defence of the dashboard's forms, and the one reader of their bodies.

The dashboard's session is a cookie, which a browser attaches by itself: a page on another site
could otherwise make an admin's browser post "start a purge" with the admin's session. Three
independent layers, each sufficient against a forged form post on its own:

1. **SameSite=Strict** session cookie (`kvguard.api.dashboard.session`): browsers attach it to no
   request that another site starts (form post, link, image, fetch), so a forged request arrives
   without credentials and is sent to the login page.
2. **Origin check** (`same_origin`), in the session middleware, on every unsafe request under
   `/dashboard` (login and logout included) before authentication: the `Origin` header (or, where a
   browser leaves it out, the `Referer`) must name this host, and `Sec-Fetch-Site`, when sent, must
   be `same-origin`. A request with neither header is refused: every browser that runs the
   dashboard sends `Origin` on a form POST. This also stops what SameSite does not: "same site"
   includes sibling subdomains (`evil.example.com` against `kvguard.example.com`), same origin does
   not, and it holds for browsers that ignore SameSite.
3. **Per-session token** in every form (`token`, checked by `read_form`): HMAC-SHA256 keyed with
   the session's API key over a fixed label. Only a holder of the key can compute it; it is bound
   to the session, so a token planted by a sibling subdomain (cookie tossing, the weakness of a
   plain double-submit cookie) is worthless; it needs no server-side state or server secret, and it
   changes when the key does. It reveals nothing about the key (HMAC is one-way).

`read_form` is a router-wide dependency of every state-changing dashboard route, so a route cannot
forget it; FastAPI solves router dependencies before the route's own, so a forged request is refused
before the route's audited action runs (nothing of it reaches the ledger). It parses
`application/x-www-form-urlencoded` with the standard library (no multipart parser needed).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Annotated, Final
from urllib.parse import parse_qsl, urlsplit

from fastapi import Depends, Request

from kvguard.api.errors import ApiError
from kvguard.errors import PermissionDeniedError

FIELD: Final = "csrf_token"
_LABEL: Final = b"kvguard/dashboard/csrf/v1"
_MAX_FIELDS: Final = 32
FORM_TYPE: Final = "application/x-www-form-urlencoded"
FORGED: Final = "the form's anti-forgery token is missing or wrong: reload the page and try again"
CROSS_ORIGIN: Final = "refused: the request did not come from a page of this dashboard"


def token(api_key: str) -> str:
    """The anti-forgery token of the session authenticated by `api_key` (module docstring, 3)."""
    return hmac.new(api_key.encode(), _LABEL, hashlib.sha256).hexdigest()


def same_origin(headers: Mapping[str, str]) -> bool:
    """Whether an unsafe request comes from a page of this host (module docstring, 2). `headers`
    has lower-case names. Only the host and port are compared: behind a TLS-terminating proxy the
    browser's `https` origin reaches the API as plain http, and the host decides the origin there."""
    host = headers.get("host", "").strip().lower()
    fetch_site = headers.get("sec-fetch-site")
    if not host or (fetch_site is not None and fetch_site != "same-origin"):
        return False
    source = headers.get("origin") or headers.get("referer")
    if not source or source == "null":
        return False
    return urlsplit(source).netloc.lower() == host


def isolated(headers: Mapping[str, str]) -> bool:
    """Whether a safe request may be answered (a resource isolation policy on the browser's
    fetch metadata): from this origin, typed by the user, or a navigation to a page; never a
    subresource another site's page asks for (`<img src=...>` on a sibling subdomain would carry the
    SameSite=Strict cookie, and some dashboard pages record what they show in the audit ledger).
    Requests without fetch metadata (older browsers, scripts) are let through, as before."""
    site = headers.get("sec-fetch-site")
    if site is None or site in {"same-origin", "none"}:
        return True
    return headers.get("sec-fetch-mode") == "navigate" and headers.get("sec-fetch-dest") in {
        None,
        "document",
    }


def first_party(headers: Mapping[str, str]) -> bool:
    """Whether a safe request that records in the audit ledger (the certificate download) comes
    from this origin or was typed by the user. A navigation from another site, a sibling subdomain
    included (it gets the SameSite=Strict cookie), passed `isolated` and recorded a certificate
    export under the signed-in user's key (found by a review). No fetch metadata: let through, as
    `isolated` does."""
    return headers.get("sec-fetch-site") in {None, "same-origin", "none"}


def bearer_key(request: Request) -> str:
    """The API key this request was authenticated with (the session middleware moved it from the
    cookie into `Authorization`, where the request gate checked it)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _invalid(problem: str) -> ApiError:
    return ApiError(
        422, "invalid", f"form: {problem}", fields=[{"field": "form", "problem": problem}]
    )


async def read_form(request: Request) -> dict[str, str]:
    """The fields of a dashboard form post, after its anti-forgery token was checked (403 when it
    is missing or wrong). 422 for a body that is not a small, well-formed, UTF-8 urlencoded form, or
    that holds a NUL (PostgreSQL text cannot store one; the API's JSON bodies are refused alike)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != FORM_TYPE:
        raise _invalid(f"must be {FORM_TYPE}")
    try:
        text = (await request.body()).decode("utf-8")
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=_MAX_FIELDS)
    except (UnicodeDecodeError, ValueError):
        raise _invalid("not a well-formed urlencoded form") from None
    fields: dict[str, str] = {}
    for name, value in pairs:
        if name in fields:
            raise _invalid(f"field {name!r} is repeated")
        if "\x00" in value or "\x00" in name:
            raise _invalid("contains a NUL character, which cannot be stored")
        fields[name] = value
    sent = fields.pop(FIELD, "")
    key = bearer_key(request)
    if not key or not hmac.compare_digest(sent.encode(), token(key).encode()):
        raise PermissionDeniedError(FORGED)
    return fields


FormDep = Annotated[dict[str, str], Depends(read_form)]
