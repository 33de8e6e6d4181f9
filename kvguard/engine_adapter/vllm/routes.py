"""Which routes of vLLM's OpenAI server a kvguard front end lets through, and how.

Deny by default: a route is reachable only if it is listed here, so a route that a new vLLM release
adds (or an endpoint plugin registers) stays closed until someone decides how it is governed.

- `PUBLIC`: health probes, no key (they touch no engine state and say nothing about tenants);
- `READ`: need a tenant key, pass through unchanged (they never reach the KV cache: listing the served
  models, tokenizing text);
- `GOVERNED`: need a tenant key and are admitted by policy; their JSON body gets the server-derived
  salt and the scope envelope (anything that runs the model, and so reads or fills the KV cache);
- `NOT_GOVERNED`: routes that run the model in a way that drops the scope envelope on its way to the
  engine (pooling, generative scoring): refused with 403 and the reason, since they would run as
  ungoverned traffic (found by a review against the real server);
- everything else (admin and dev routes: `/reset_prefix_cache`, `/sleep`, LoRA loading, metrics that
  aggregate every tenant, stored responses by id, ...) is refused with 403 even with a valid key.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from enum import StrEnum
from typing import Any, Final

from starlette._utils import get_route_path  # the function the router strips root_path with


class RouteClass(StrEnum):
    PUBLIC = "public"
    READ = "read"
    GOVERNED = "governed"
    REFUSED = "refused"


PUBLIC: Final = frozenset({("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")})
READ: Final = frozenset({("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize")})
GOVERNED: Final = frozenset(
    ("POST", path)
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/invocations",
    )
)
# Routes that run the model but that kvguard cannot govern: the tenant's scope envelope never
# reaches the engine through them, so they would run as ungoverned traffic (outside the tenant's
# quota, policy and purges, recorded under no tenant). Refused (403) with the reason.
_POOLING = (
    "pooling requests (embeddings, scoring, classification, reranking) carry no scope to the "
    "engine, and kvguard engine serve does not start a pooling model"
)
NOT_GOVERNED: Final[dict[tuple[str, str], str]] = {
    ("POST", "/generative_scoring"): (
        "vLLM builds its own sampling parameters for every scored item and drops the tenant's "
        "scope; use /v1/completions with logprobs instead"
    ),
    **{
        ("POST", path): _POOLING
        for path in (
            "/v1/embeddings",
            "/pooling",
            "/classify",
            "/score",
            "/v1/score",
            "/rerank",
            "/v1/rerank",
            "/v2/rerank",
        )
    },
}


POOLING_REFUSED: Final = (
    "kvguard governs generative models only: a pooling model's requests (embeddings, scoring, "
    "classification, reranking) carry no tenant scope to the engine, so they would run outside "
    "every tenant's policy, quota and purges; serve pooling models without kvguard "
    "(--runner pooling / --convert are refused)"
)


def route_path(path: str) -> str:
    """The route a request path names: a trailing slash is not a different route."""
    return path.rstrip("/") or "/"


def scope_route(scope: MutableMapping[str, Any]) -> str:
    """The route an ASGI request is for: its path less the app's `root_path` (vLLM's `--root-path`,
    behind a proxy that keeps the prefix), exactly as Starlette's router strips it before it
    dispatches. Classified on the raw path, every route behind a prefix was refused, health
    probes included (found by a review)."""
    return route_path(get_route_path(scope))


def refusal(method: str, path: str) -> str:
    """The 403 answer for a refused route: why, where kvguard knows a reason beyond "not listed"."""
    reason = NOT_GOVERNED.get((method.upper(), route_path(path)))
    return "this route is not served through kvguard" + (f": {reason}" if reason else "")


def classify(method: str, path: str) -> RouteClass:
    """How a request for `method path` is handled."""
    key = (method.upper(), route_path(path))
    if key in PUBLIC:
        return RouteClass.PUBLIC
    if key in READ:
        return RouteClass.READ
    if key in GOVERNED:
        return RouteClass.GOVERNED
    return RouteClass.REFUSED
