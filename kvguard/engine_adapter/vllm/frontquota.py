"""Quota refusals at the front end: policy `quota.when_full: reject` (issue 10, item 6).

With `when_full: wait` (the default) a request that would take its tenant's running work past
`quota.max_blocks` waits in vLLM's queue until the tenant's own requests leave room (the connector,
`scheduler_side.may_schedule`). The engine cannot refuse a request vLLM has queued (an exception
there stops the engine core), so a tenant that wants a fast, clear refusal instead sets
`when_full: reject`, and the front end refuses before the engine sees the request:

- it counts the blocks the request needs, `ceil((prompt tokens + max_tokens) / block size)` per
  sequence, the prompt tokenized by vLLM's own tokenization service (`app.state.
  serving_tokenization`: the same chat template and tokenizer the engine will use), `max_tokens`
  defaulting to what vLLM fills in (the model's length less the prompt);
- it holds, per tenant, the blocks of that tenant's requests in flight through this front end (from
  admission until the response has been sent or the client has gone), an upper bound of what they
  can occupy in the engine: prefix hits and early stops only make the real figure smaller;
- a request that can never fit (more blocks than the whole quota) is `400`; one that would take the
  tenant's requests in flight past the quota is `429` with `Retry-After`, naming the figures, and a
  `quota.reject` ledger entry under the tenant's tag (so its own export shows it); the admin API
  counts them in `kvguard_tenant_quota_rejections_total`.

One front end process sees its own requests only: with several API server processes in front of one
engine, each holds a tenant to the quota on its own (set the quota per process accordingly); the
engine still holds every tenant to it by making requests wait.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from kvguard.audit.events import AuditEvent, EventKind
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.engine_adapter.vllm.routes import route_path
from kvguard.errors import KvguardError
from kvguard.isolation.salts import SaltDeriver
from kvguard.logging import get_logger

_log = get_logger("vllm.quota")
RETRY_AFTER_S: Final = 1
_CHAT_FIELDS: Final = (
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
# What each governed route reads as its prompt and its output length (vLLM's own request types):
# a field another route reads counts nothing here, as it counts nothing in the engine (a decoy
# `messages` on /v1/completions must not replace the prompt that runs).
_CHAT_ROUTES: Final = frozenset({"/v1/chat/completions", "/v1/messages"})
_TEXT_ROUTES: Final = frozenset({"/v1/completions"})
_GENERATING: Final = _CHAT_ROUTES | _TEXT_ROUTES | {"/v1/responses", "/invocations"}


class QuotaRefusalError(Exception):
    """The front end answers `status` with `message`; the engine never sees the request."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


@dataclass(frozen=True, slots=True)
class Reservation:
    tenant: str
    blocks: int


class InFlight:
    """Blocks each tenant's admitted requests may use, held until their response ends. Runs on the
    event loop only (no await between the check and the hold), so no lock is needed."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def take(self, tenant: str, blocks: int, cap: int) -> Reservation | None:
        """Hold `blocks` for `tenant` if that keeps it within `cap`; None (nothing held) if not."""
        if self.held(tenant) + blocks > cap:
            return None
        self._held[tenant] = self.held(tenant) + blocks
        return Reservation(tenant, blocks)

    def release(self, reservation: Reservation) -> None:
        left = self.held(reservation.tenant) - reservation.blocks
        if left > 0:
            self._held[reservation.tenant] = left
        else:
            self._held.pop(reservation.tenant, None)


async def prompt_tokens(scope: MutableMapping[str, Any], doc: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens over every prompt of the request, the model's maximum length; 0 when
    unknown), read the way the request's route reads its body: `messages` on the chat routes,
    `prompt` on /v1/completions, the larger of both on /invocations (vLLM picks the request type
    from the body there), `input` on /v1/responses and the pooling routes, with a top-level `system`
    on /v1/messages and `instructions` and `tools` on /v1/responses. Tokenized by vLLM's
    own service; what it cannot tokenize counts the characters of its strings, an upper bound (a
    token is at least one character), so an unusual body can never make a request look smaller
    than it is."""
    state = getattr(scope.get("app"), "state", None)
    serving = getattr(state, "serving_tokenization", None)
    config = getattr(state, "vllm_config", None)
    max_len = int(getattr(getattr(config, "model_config", None), "max_model_len", 0) or 0)
    route = _route(scope)
    counts: list[int] = []
    if route in _CHAT_ROUTES or (route == "/invocations" and "messages" in doc):
        counts.append(await _chat_tokens(scope, serving, doc))
    if route in _TEXT_ROUTES or (route == "/invocations" and "prompt" in doc):
        counts.append(await _text_tokens(scope, serving, doc.get("model"), doc.get("prompt")))
    if route not in _CHAT_ROUTES and route not in _TEXT_ROUTES and route != "/invocations":
        # /v1/responses renders `instructions` and `tools` too; pooling routes read `input`
        # (an upper bound; a body without `input` counts as a whole).
        rendered = [doc.get(k) for k in ("input", "instructions", "tools")]
        counts.append(_characters(rendered if "input" in doc else doc))
    return max(counts, default=0), max_len


def _route(scope: MutableMapping[str, Any]) -> str:
    return route_path(str(scope.get("path", "")))


def output_tokens(doc: dict[str, Any], route: str) -> int | None:
    """The output length the request asks for, in the field its route reads: `max_output_tokens` on
    /v1/responses, `max_completion_tokens` else `max_tokens` on /v1/chat/completions, the larger
    of both on /invocations (the body decides which request it is), `max_tokens` elsewhere (an
    extra `max_completion_tokens` on /v1/completions or /v1/messages is ignored by vLLM, so it must
    not make the request look shorter). Numbers are read as vLLM's models coerce them (`1000.0`,
    `"1000"`). None when it asks for none, or for something vLLM will not take (vLLM then fills in
    the rest of the model's length, or refuses the request)."""
    if route == "/v1/responses":
        return _count(doc.get("max_output_tokens"))
    if route == "/v1/chat/completions":
        first = _count(doc.get("max_completion_tokens"))
        return first if first is not None else _count(doc.get("max_tokens"))
    if route == "/invocations":
        both = [_count(doc.get(k)) for k in ("max_completion_tokens", "max_tokens")]
        return max((n for n in both if n is not None), default=None)
    return _count(doc.get("max_tokens"))


def _count(value: object) -> int | None:
    """A positive whole number as vLLM's request models read one (an int, an integral float, a
    numeric string), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


async def _chat_tokens(scope: MutableMapping[str, Any], serving: Any, doc: dict[str, Any]) -> int:
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest  # noqa: PLC0415

    anthropic = _route(scope) == "/v1/messages"
    # /v1/messages renders a top-level `system` and Anthropic-format `tools` into the prompt too:
    # counted by their characters (an upper bound), the messages by vLLM's tokenizer.
    extra = _characters([doc.get("system"), doc.get("tools")]) if anthropic else 0
    names = tuple(k for k in _CHAT_FIELDS if k != "tools") if anthropic else _CHAT_FIELDS
    fields = {k: doc[k] for k in names if k in doc}
    request = _validated(TokenizeChatRequest, fields)
    counted = None if request is None else await _tokenize(scope, serving, request)
    if counted is None:
        counted = _characters([fields.get("messages"), fields.get("tools")])
    return counted + extra


async def _text_tokens(
    scope: MutableMapping[str, Any], serving: Any, model: object, prompt: object
) -> int:
    if isinstance(prompt, list) and _is_token_ids(prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(_is_token_ids(p) for p in prompt):
        return sum(len(p) for p in prompt)
    from vllm.entrypoints.serve.tokenize.protocol import (  # noqa: PLC0415
        TokenizeCompletionRequest,
    )

    total = 0
    for text in prompt if isinstance(prompt, list) else [prompt]:
        request = _validated(TokenizeCompletionRequest, {"model": model, "prompt": text})
        counted = None if request is None else await _tokenize(scope, serving, request)
        if counted is None:
            return _characters(prompt)
        total += counted
    return total


def _validated(model: Any, fields: dict[str, Any]) -> Any:
    """`model` validated from `fields`, None if they do not validate. The caller counts characters
    instead, outside any exception handler: the validation error quotes the body (G6) and must not
    be chained into a later traceback."""
    try:
        return model.model_validate(fields)
    except (ValueError, TypeError, RecursionError):
        return None


async def _tokenize(scope: MutableMapping[str, Any], serving: Any, request: Any) -> int | None:
    """The token count vLLM's tokenization service gives `request`; None if it gives none."""
    if serving is None:
        return None
    from fastapi import Request  # noqa: PLC0415 - vLLM's server brings FastAPI

    try:
        answer = await serving.create_tokenize(request, Request(dict(scope)))
    except (ValueError, TypeError):
        return None
    count = getattr(answer, "count", None)
    return count if isinstance(count, int) else None


def _characters(value: object) -> int:
    """Characters of every string in `value` (and one per token id): at least its token count.
    A walk with its own stack: a body nested as deep as the JSON parser goes must not overflow
    Python's (found by a review: a 500 with a traceback quoting the prompt)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            total += 1
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def blocks_needed(
    doc: dict[str, Any], prompt: int, max_len: int, block_size: int, route: str = ""
) -> int:
    """Blocks for every sequence of the request: (prompt + output) rounded up, times `n`. The
    output is what the route reads (`output_tokens`; what vLLM fills in when absent); pooling
    routes generate none."""
    if route and route not in _GENERATING:
        return max(math.ceil(prompt / block_size), 1)
    output = output_tokens(doc, route)
    if output is None:
        output = max(max_len - prompt, 1) if max_len else 1  # what vLLM fills in
    sequences = _count(doc.get("n")) or 1  # `6.0` and `"6"` are six sequences to vLLM
    return math.ceil((prompt + output) / block_size) * sequences


class FrontQuota:
    """The middleware's quota keeper for tenants with `when_full: reject` (module docstring)."""

    def __init__(self, deriver: SaltDeriver, ledger: Ledger | None = None) -> None:
        self._deriver = deriver
        self._ledger = ledger if ledger is not None else ledger_from_environment()
        self.in_flight = InFlight()

    async def hold(
        self,
        scope: MutableMapping[str, Any],
        tenant: str,
        doc: dict[str, Any],
        *,
        cap: int,
        block_size: int,
    ) -> Reservation:
        """Hold the request's blocks against its tenant's quota, or refuse it: 400 if it can
        never fit, 429 while the tenant's requests in flight leave no room (a `quota.reject`
        entry)."""
        prompt, max_len = await prompt_tokens(scope, doc)
        needed = blocks_needed(doc, prompt, max_len, block_size, _route(scope))
        if needed > cap:
            raise QuotaRefusalError(
                400,
                f"this request needs {needed} KV blocks of {block_size} tokens (prompt and "
                f"max_tokens); this tenant's quota is {cap} blocks: it can never run",
            )
        held = self.in_flight.take(tenant, needed, cap)
        if held is not None:
            return held
        in_flight = self.in_flight.held(tenant)
        self._record(tenant, needed, in_flight, cap)
        raise QuotaRefusalError(
            429,
            f"quota exceeded: this tenant's requests in flight hold {in_flight} of its {cap} KV "
            f"blocks and this request needs {needed}; retry when one finishes",
            retry_after=RETRY_AFTER_S,
        )

    def release(self, reservation: Reservation) -> None:
        self.in_flight.release(reservation)

    def _record(self, tenant: str, needed: int, held: int, cap: int) -> None:
        _log.info("request refused: tenant quota full", blocks_requested=needed, blocks_quota=cap)
        if self._ledger is None:
            return
        event = refusal_event(self._deriver.tenant_tag(tenant), needed=needed, held=held, cap=cap)
        try:
            self._ledger.submit(event)
        except KvguardError as exc:  # a full ledger queue: the refusal stands, the log says why
            _log.warning("quota refusal not recorded", error=type(exc).__name__)


def ledger_from_environment() -> Ledger | None:
    """The ledger refusals are recorded in: `kvguard engine serve` passes the database, the signing
    key file and the origin; mounted elsewhere without them, refusals are only logged."""
    url, key_file = os.environ.get("KVGUARD_DB_URL"), os.environ.get("KVGUARD_SIGNING_KEY_FILE")
    if not url or not key_file:
        return None
    origin = os.environ.get("KVGUARD_LEDGER_ORIGIN", "kvguard.local/ledger")
    keys = [SigningKey.load(path) for path in key_file.split(os.pathsep) if path]  # a rotation: 2
    return Ledger.open(url, origin=origin, signing_key=keys)


def refusal_event(
    tenant_tag: str, *, needed: int, held: int, cap: int, now: Callable[[], datetime] | None = None
) -> AuditEvent:
    """The `quota.reject` ledger entry (figures only: no prompt, no key, G6)."""
    return AuditEvent(
        kind=EventKind.QUOTA_REJECT,
        scope_tag=tenant_tag,
        ts=(now or _utc_now)(),
        details={"blocks_requested": needed, "blocks_in_flight": held, "blocks_quota": cap},
    )


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    )
