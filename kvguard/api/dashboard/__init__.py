"""The compliance dashboard: server-rendered HTML pages over the admin API, under `/dashboard`.

Owns: the browser session (`session`: the API key in an HttpOnly, SameSite=Strict cookie, checked on
every request by the API's own request gate), the defence against forged form posts (`csrf`), the
pages (`views`, read-only) and the actions (`forms`), their templates and stylesheet, and the pure
helpers behind them (`summaries`: policy text diffs, checkpoint signers, certificate verification).

Never: decides a role or a tenant scope (every page and action calls the JSON API's route functions
with the `Access` / `Action` of `kvguard.api.deps`, so the dashboard shows and does exactly what the
caller's key may do through the API); renders a secret (API keys, salts, signing keys; new inference
keys are issued through the API or the CLI, where they are shown once); runs a script in the browser
(plain HTML forms; the CSP forbids scripts); needs a build step. docs/dashboard.md describes it.
"""

from __future__ import annotations

from fastapi import FastAPI

from kvguard.api.dashboard import forms, views
from kvguard.api.dashboard.session import DashboardSession


def install(app: FastAPI) -> None:
    """Mount the dashboard on `app` (`kvguard.api.app.create_app`). Call it after adding the request
    gate and before the error guard: the session middleware must run outside the gate (to answer
    the login form, which has no key yet, and to hand the gate the cookie's key) and inside the
    guard and the access log (so its answers are logged and its failures answered)."""
    app.include_router(views.router)
    app.include_router(forms.router)
    app.add_middleware(DashboardSession, services=app.state.services)
