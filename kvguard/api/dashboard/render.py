"""HTML rendering: the Jinja2 templates (autoescaped), the page a route renders for its caller, and
the navigation each role gets.

A `Page` is what a view receives: the request and the `Access` that `kvguard.api.deps.require`
granted (the same dependency the JSON routes use), so a view never decides roles or tenants itself.
Navigation and the forms a page shows follow the role only to spare a user buttons that would be
refused; the refusal itself is the API's (403/404), whatever the page showed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

import jinja2
from fastapi import Depends, Request
from fastapi.responses import HTMLResponse

from kvguard.api.auth import Principal, Role
from kvguard.api.dashboard import csrf
from kvguard.api.dashboard.summaries import format_ts
from kvguard.api.deps import ADMINS, TENANT_WRITERS, Access, require

PREFIX: Final = "/dashboard"
LOGIN: Final = f"{PREFIX}/login"
LOGOUT: Final = f"{PREFIX}/logout"
STYLESHEET: Final = f"{PREFIX}/static/dashboard.css"

# What a redirect after a successful form post may announce: fixed texts chosen by a code in the
# query string, so nothing the user (or a link's author) wrote is ever echoed as a message.
NOTICES: Final = {
    "tenant-created": "Tenant created.",
    "tenant-disabled": "Tenant disabled: a policy version refuses its requests, and a tenant purge "
    "was queued (below).",
    "policy-stored": "Policy version stored; engines switch to it at their next poll.",
    "purge-started": "Purge queued for every engine.",
    "key-revoked": "Inference key revoked; the serving front end refuses it from its next request.",
    "checkpoint-signed": "Checkpoint signed.",
    "signed-out": "Signed out.",
}

_ENV: Final = jinja2.Environment(
    loader=jinja2.PackageLoader("kvguard.api.dashboard", "templates"),
    autoescape=True,  # every template is HTML: nothing a tenant or an admin typed is markup
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters["ts"] = format_ts


def path_segment(value: object) -> str:
    """`value` percent-encoded as one URL path segment: every character but the unreserved ones
    and `:` / `@` (RFC 3986 `pchar`; a valid tenant id such as `org:acme` stays as typed), so a
    stored id with `/`, `?`, `#`, `%` or a quote stays inside its segment (the API refuses such
    tenant ids, but a page renders whatever the database holds). In templates:
    `{{ tenant.tenant_id | segment }}`; autoescaping then makes it safe inside the attribute."""
    return quote(str(value), safe=":@")


def dashboard_path(*segments: object) -> str:
    """The dashboard path of `segments`, each encoded by `path_segment`."""
    return "/".join([PREFIX, *(path_segment(s) for s in segments)])


_ENV.filters["segment"] = path_segment


@dataclass(frozen=True, slots=True)
class NavItem:
    label: str
    href: str
    current: bool


def navigation(principal: Principal | None, path: str) -> list[NavItem]:
    """The main navigation for the caller's role (`current`: the section `path` is in)."""
    if principal is None:
        return []
    items = [("Overview", f"{PREFIX}/")]
    if principal.role is Role.TENANT_ADMIN and principal.tenant_id:
        items.append(("My tenant", dashboard_path("tenants", principal.tenant_id)))
    else:
        items += [("Tenants", f"{PREFIX}/tenants"), ("Policies", f"{PREFIX}/policies")]
    items += [
        ("Purges", f"{PREFIX}/purges"),
        ("Cache", f"{PREFIX}/cache"),
        ("Ledger", f"{PREFIX}/ledger"),
    ]
    return [NavItem(label, href, _in_section(path, href)) for label, href in items]


def _in_section(path: str, href: str) -> bool:
    if href == f"{PREFIX}/":
        return path in {PREFIX, f"{PREFIX}/"}
    return path == href or path.startswith(f"{href}/")


def render(template: str, **context: Any) -> str:
    """A template rendered with `context` (every page template extends `base.html`, which needs
    `me`, `nav`, `notice` and `csrf_token`)."""
    return _ENV.get_template(template).render(**context)


def anonymous_page(
    template: str, *, status_code: int = 200, notice: str | None = None, **context: Any
) -> HTMLResponse:
    """A page for a caller without a session (login, errors answered by the session middleware);
    `notice` is a code of `NOTICES`."""
    html = render(
        template, me=None, nav=[], notice=NOTICES.get(notice or ""), csrf_token="", **context
    )
    return HTMLResponse(html, status_code=status_code)


@dataclass(frozen=True, slots=True)
class Page:
    """What a view renders for its authenticated caller."""

    request: Request
    access: Access

    @property
    def principal(self) -> Principal:
        return self.access.principal

    def render(self, template: str, /, *, status_code: int = 200, **context: Any) -> HTMLResponse:
        principal = self.principal
        notice = NOTICES.get(self.request.query_params.get("notice", ""))
        html = render(
            template,
            me=principal,
            nav=navigation(principal, self.request.url.path),
            notice=notice,
            csrf_token=csrf.token(csrf.bearer_key(self.request)),
            is_admin=principal.role in ADMINS,
            may_write=principal.role in TENANT_WRITERS,
            **context,
        )
        return HTMLResponse(html, status_code=status_code)


def viewer(*roles: Role) -> Any:
    """A dependency giving a `Page` to callers holding one of `roles` (403 for the others, through
    `kvguard.api.deps.require`)."""

    # A default, not `Annotated[...]`: under `from __future__ import annotations` FastAPI evaluates
    # annotations in the module's globals, where `roles` does not exist.
    granted = require(*roles)

    def dependency(request: Request, access: Access = granted) -> Page:
        return Page(request, access)

    return Depends(dependency)
