"""How a request's scope travels from the front end (`GuardedLLM`, the serve middleware) to the engine.

The scope rides in `SamplingParams.extra_args["kvguard"]`, which vLLM carries unchanged to the engine
core process in both in-process and multiprocess modes. It is *not* trusted on its own: the engine side
re-derives the salt from the scope with its own keyring and refuses prefix caching for a request whose
`cache_salt` does not match (G1). A request with no kvguard envelope at all is ungoverned traffic: it
gets no prefix cache and nothing of it is retained (G7, fail closed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from kvguard.errors import ScopeError
from kvguard.isolation.scope import Scope

ENVELOPE_KEY: Final = "kvguard"
_VERSION: Final = 1


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
        doc: dict[str, Any] = {
            "v": _VERSION,
            "scope": self.scope.model_dump(mode="json"),
            "use_cache": self.use_cache,
        }

        return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def read_envelope(extra_args: dict[str, Any] | None) -> Envelope | None:
    """The envelope in `extra_args`, None if there is none; ScopeError if it is malformed."""
    if not extra_args or ENVELOPE_KEY not in extra_args:
        return None
    raw = extra_args[ENVELOPE_KEY]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ScopeError("kvguard envelope is not valid JSON") from None
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
