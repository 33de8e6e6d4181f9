"""How a request's scope travels from the front end (`GuardedLLM`, the serve middleware) to the engine.

The scope rides in `SamplingParams.extra_args["kvguard"]`, which vLLM carries unchanged to the engine
core process in both in-process and multiprocess modes. It is *not* trusted on its own: the engine side
re-derives the salt from the scope with its own keyring and refuses prefix caching for a request whose
`cache_salt` does not match (G1). A request with no kvguard envelope at all is ungoverned traffic: it
gets no prefix cache and nothing of it is retained (G7, fail closed).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from kvguard.errors import ScopeError
from kvguard.isolation.scope import Scope

ENVELOPE_KEY: Final = "kvguard"
_VERSION: Final = 1
_CACHE: Final = 4096  # distinct envelopes remembered (a handful per tenant)


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the front end decided for one request: its scope and whether it may use the cache."""

    scope: Scope
    use_cache: bool
    # Set by the engine for group scopes (never read from the wire): how many leading tokens the
    # share group may share; blocks past them are not retained for the group. None: no limit.
    share_tokens: int | None = None

    def to_extra_args(self) -> dict[str, Any]:
        return {ENVELOPE_KEY: self.to_json()}

    def to_json(self) -> str:
        """One JSON string: `vllm serve` only passes flat values through `vllm_xargs`."""
        return _wire(self.scope, self.use_cache)


@functools.lru_cache(maxsize=_CACHE)
def _wire(scope: Scope, use_cache: bool) -> str:
    # Cached: a front end sends the same few scopes over and over (scopes are frozen).
    doc: dict[str, Any] = {
        "v": _VERSION,
        "scope": scope.model_dump(mode="json"),
        "use_cache": use_cache,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def read_envelope(extra_args: dict[str, Any] | None) -> Envelope | None:
    """The envelope in `extra_args`, None if there is none; ScopeError if it is malformed."""
    if not extra_args or ENVELOPE_KEY not in extra_args:
        return None
    raw = extra_args[ENVELOPE_KEY]
    if isinstance(raw, str):
        return _read_wire(raw)
    return _read(raw)


@functools.lru_cache(maxsize=_CACHE)
def _read_wire(raw: str) -> Envelope:
    """The envelope of one wire string. Cached: the engine sees the same few envelopes over and over,
    and the result (a frozen envelope and scope) depends on the string alone, so the scope's domain
    key is computed once, not per request. (Refusals raise and are not cached.)"""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise ScopeError("kvguard envelope is not valid JSON") from None
    return _read(doc)


def _read(raw: object) -> Envelope:
    if not isinstance(raw, dict) or raw.get("v") != _VERSION:
        raise ScopeError("kvguard envelope has an unknown version")
    try:
        scope = Scope.model_validate(raw["scope"])
    except (KeyError, ValidationError) as exc:
        raise ScopeError(
            f"kvguard envelope carries an invalid scope ({type(exc).__name__})"
        ) from None
    use_cache = raw.get("use_cache")
    if not isinstance(use_cache, bool):
        raise ScopeError("kvguard envelope: use_cache must be a boolean")
    return Envelope(scope=scope, use_cache=use_cache)
