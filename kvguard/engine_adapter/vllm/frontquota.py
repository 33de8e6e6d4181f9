"""Quota refusals at the front end: policy `quota.when_full: reject` (issue 10, item 6).

With `when_full: wait` (the default) a request that would take its tenant's running work past
`quota.max_blocks` waits in vLLM's queue until the tenant's own requests leave room (the connector,
`scheduler_side.may_schedule`). The engine cannot refuse a request vLLM has queued (an exception
there stops the engine core), so a tenant that wants a fast, clear refusal instead sets
`when_full: reject`, and the front end refuses before the engine sees the request:

- it counts the blocks the request needs, `ceil((prompt tokens + max_tokens) / block size)` per
  sequence, for each prompt of a batch (vLLM runs each item of `prompt: [...]` as its own request),
  the prompt tokenized by vLLM's own tokenization service (`app.state.
  serving_tokenization`: the same chat template and tokenizer the engine will use), `max_tokens`
  defaulting to what vLLM fills in (the model's length less the prompt); what the chat template
  renders besides `messages` (`documents`, `response_format`, ...) counts its characters;
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

import json
import math
import os
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import zip_longest
from typing import Any, Final

from kvguard.audit.events import AuditEvent, EventKind
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.engine_adapter.vllm.routes import scope_route
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
    # How media become prompt tokens (frames of a video, image sizes): tokenized with the
    # request's own settings, not the defaults (a re-test found them counted at defaults).
    "mm_processor_kwargs",
    "media_io_kwargs",
)
# Chat body fields vLLM reads only as sampling or serving options, never rendered into the prompt:
# they count nothing, whatever their value (a re-test found `stop` lists and `stream_options`,
# which the OpenAI SDK sends, refusing ordinary requests under a small quota). Every other field
# beside the tokenized ones counts the characters of its JSON text, since renderers put more of the
# body into the prompt than the tokenization service takes (`ChatCompletionRequest.
# build_chat_params`: `documents`, `reasoning_effort`, `response_format`, `tool_choice`; a review
# found a 1,000-word `documents` entry running under a 4-block reject quota). An unknown field
# counts: over-counting refuses early, under-counting runs past the quota.
_NOT_RENDERED: Final = frozenset(
    {
        "model", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k",
        "min_p", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "length_penalty", "logprobs", "top_logprobs", "prompt_logprobs", "stream", "user",
        "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "echo", "add_special_tokens", "priority", "request_id",
        "cache_salt", "truncate_prompt_tokens", "truncation_side", "parallel_tool_calls",
        "include_reasoning", "stream_interval", "return_tokens_as_token_ids", "return_token_ids",
        "stop", "stop_token_ids", "stream_options", "logit_bias", "bad_words",
        "allowed_token_ids", "structured_outputs", "vllm_xargs", "kv_transfer_params",
        "logits_processors",
    }
)  # fmt: skip
_RESPONSES_NOT_RENDERED: Final = _NOT_RENDERED | {
    "input", "max_output_tokens", "store", "background", "previous_response_id", "service_tier"
}  # fmt: skip
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


async def prompt_tokens(
    scope: MutableMapping[str, Any], doc: dict[str, Any]
) -> tuple[tuple[int, ...], int]:
    """(prompt tokens of each request vLLM makes of this one, the model's maximum length; 0 when
    unknown): one count per item of a batched `prompt` on /v1/completions, one count elsewhere;
    read the way the request's route reads its body: `messages` on the chat routes,
    `prompt` on /v1/completions, the larger of both on /invocations (vLLM picks the request type
    from the body there), `input` on /v1/responses and the pooling routes, with a top-level `system`
    on /v1/messages and `instructions` and `tools` on /v1/responses, and on the chat routes every
    other field the chat template can render (all but `_NOT_RENDERED`). Tokenized by vLLM's
    own service; what it cannot tokenize counts the characters of its strings, an upper bound (a
    token is at least one character), so an unusual body can never make a request look smaller
    than it is."""
    state = getattr(scope.get("app"), "state", None)
    serving = getattr(state, "serving_tokenization", None)
    config = getattr(state, "vllm_config", None)
    max_len = int(getattr(getattr(config, "model_config", None), "max_model_len", 0) or 0)
    route = _route(scope)
    readings: list[tuple[int, ...]] = []
    if route in _CHAT_ROUTES or (route == "/invocations" and "messages" in doc):
        readings.append((await _chat_tokens(scope, serving, doc),))
    if route in _TEXT_ROUTES or (route == "/invocations" and "prompt" in doc):
        readings.append(await _text_tokens(scope, serving, doc.get("model"), doc.get("prompt")))
    if route == "/v1/responses" and "input" in doc:
        # `input` by the characters of its strings, and, as on the chat routes, every other field
        # the template can render (`instructions`, `tools`, `text`, `reasoning`, ...) by its JSON
        # text: only `input`, `instructions` and `tools` counted, a `text.format` schema or other
        # rendered fields ran uncounted.
        others = (v for k, v in doc.items() if k not in _RESPONSES_NOT_RENDERED)
        readings.append((_characters(doc["input"]) + sum(map(_json_characters, others)),))
    elif route not in _CHAT_ROUTES and route not in _TEXT_ROUTES and route != "/invocations":
        # Pooling routes read `input` (an upper bound; a body without `input` counts as a whole).
        readings.append((_characters(doc.get("input") if "input" in doc else doc),))
    return _widest(readings), max_len


def _widest(readings: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The largest count any reading puts at each position: never fewer blocks than the reading
    vLLM picks (/invocations), since blocks grow with every count and with the number of them."""
    return tuple(max(column) for column in zip_longest(*readings, fillvalue=0)) or (0,)


def _route(scope: MutableMapping[str, Any]) -> str:
    return scope_route(scope)


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

    # /v1/messages renders a top-level `system` and Anthropic-format `tools` (not the tokenizer's
    # format) into the prompt too: counted with the other rendered fields below.
    anthropic = _route(scope) == "/v1/messages"
    names = tuple(k for k in _CHAT_FIELDS if k != "tools") if anthropic else _CHAT_FIELDS
    fields = {k: doc[k] for k in names if k in doc}
    request = _validated(TokenizeChatRequest, fields)
    counted = None if request is None else await _tokenize(scope, serving, request)
    if counted is None:  # the messages by their characters, every other field as rendered below
        counted, fields = _characters(doc.get("messages")), {}
    # `prompt` is the completion reading (counted on its own on /invocations; vLLM's chat request
    # ignores it): a decoy there counts nothing.
    counted_above = {*fields, "messages", "prompt"}
    rendered = [
        value for key, value in doc.items() if key not in counted_above and key not in _NOT_RENDERED
    ]
    return counted + sum(_json_characters(value) for value in rendered)


async def _text_tokens(
    scope: MutableMapping[str, Any], serving: Any, model: object, prompt: object
) -> tuple[int, ...]:
    """One count per request vLLM makes of `prompt`: each item of a list of strings or of
    token-id lists runs as its own request, with its own output (reviewer's finding: summed into
    one count, 50 one-token prompts counted 3 blocks where the engine takes 50)."""
    if isinstance(prompt, list) and _is_token_ids(prompt):
        return (len(prompt),)
    items = prompt if isinstance(prompt, list) and prompt else [prompt]
    return tuple([await _one_prompt(scope, serving, model, item) for item in items])


async def _one_prompt(
    scope: MutableMapping[str, Any], serving: Any, model: object, item: object
) -> int:
    if isinstance(item, list) and _is_token_ids(item):
        return len(item)
    from vllm.entrypoints.serve.tokenize.protocol import (  # noqa: PLC0415
        TokenizeCompletionRequest,
    )

    request = _validated(TokenizeCompletionRequest, {"model": model, "prompt": item})
    counted = None if request is None else await _tokenize(scope, serving, request)
    return _characters(item) if counted is None else counted


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


def _json_characters(value: object) -> int:
    """Characters of `value` as JSON text (ASCII-escaped, default separators), what a template
    renders with `tojson`, and at least the characters of its strings as rendered as text. A walk
    with its own stack, as `_characters`: `json.dumps` recurses and would raise on a deep body."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list | dict):  # brackets and ", " between items
            total += 2 + 2 * max(len(item) - 1, 0)
        if isinstance(item, dict):  # each key and its ": "
            total += sum(len(json.dumps(str(key))) + 2 for key in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            total += len(json.dumps(item))
    return total


def blocks_needed(
    doc: dict[str, Any],
    prompts: int | Sequence[int],
    max_len: int,
    block_size: int,
    route: str = "",
) -> int:
    """Blocks for every sequence of the request: for each prompt (`prompt_tokens`; an int is one
    prompt), (prompt + output) rounded up, times `n`. The output is what the route reads
    (`output_tokens`; what vLLM fills in for each prompt when absent); pooling routes generate
    none."""
    counts = (prompts,) if isinstance(prompts, int) else tuple(prompts) or (0,)
    if route and route not in _GENERATING:
        return sum(max(math.ceil(prompt / block_size), 1) for prompt in counts)
    asked = output_tokens(doc, route)
    sequences = _count(doc.get("n")) or 1  # `6.0` and `"6"` are six sequences to vLLM
    per_prompt = [math.ceil((p + _output(asked, p, max_len)) / block_size) for p in counts]
    return sum(per_prompt) * sequences


def _output(asked: int | None, prompt: int, max_len: int) -> int:
    """The output tokens vLLM gives one prompt: what the request asks, else what vLLM fills in."""
    if asked is not None:
        return asked
    return max(max_len - prompt, 1) if max_len else 1


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
