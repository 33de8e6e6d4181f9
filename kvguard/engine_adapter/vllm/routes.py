"""Which routes of vLLM's OpenAI server a kvguard front end lets through, and how.

Deny by default: a route is reachable only if it is listed here, so a route that a new vLLM release
adds (or an endpoint plugin registers) stays closed until someone decides how it is governed.

- `PUBLIC`: health probes, no key (they touch no engine state and say nothing about tenants);
- `READ`: need a tenant key, pass through unchanged (they never reach the KV cache: listing the served
  models, tokenizing text);
- `GOVERNED`: need a tenant key and are admitted by policy; their JSON body gets the server-derived
  salt and the scope envelope (anything that runs the model, and so reads or fills the KV cache);
- everything else (admin and dev routes: `/reset_prefix_cache`, `/sleep`, LoRA loading, metrics that
  aggregate every tenant, stored responses by id, ...) is refused with 403 even with a valid key.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


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
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/invocations",
        "/generative_scoring",
    )
)


def route_path(path: str) -> str:
    """The route a request path names: a trailing slash is not a different route."""
    return path.rstrip("/") or "/"


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
