"""ASGI middleware that puts kvguard in front of vLLM's OpenAI-compatible server.

`kvguard engine serve MODEL [vLLM options]` mounts it (docs/vllm.md). For every HTTP request it:
1. classifies the route (`routes.classify`): health probes pass; every other route needs a tenant key,
   and only the listed inference and read-only routes are served (deny by default);
2. maps `Authorization: Bearer <key>` to a tenant through the tenant registry (`TenantKeys`); a
   missing, unknown or revoked key gets 401 before the body is read, so no engine work happens;
3. asks policy (`admit`) for the tenant's scope (optional `X-KVGuard-Session` header for session
   scope, `X-KVGuard-Share: group:<id>` or `public` to ask for wider sharing, which policy narrows
   to the tenant where it does not allow it); a refused request (a disabled tenant, say) gets 403;
4. on governed routes, drops any client `cache_salt` from the JSON body, sets the salt derived by the
   server, and adds the scope envelope to `vllm_xargs`, which vLLM turns into the request's
   `extra_args` for the connector to check (G1).

It is a pure pass-through otherwise: after the (rewritten) body, every `receive()` goes to the real
connection, so a client that disconnects reaches vLLM, which aborts the request and frees its blocks.

The scope describes the engine the middleware sits in front of: model id and revision, tokenizer, KV
dtype and block size are read from the engine's own configuration (`app.state.vllm_config`, set by
vLLM before it serves), never from a second default; a LoRA adapter named in the request's `model`
enters the scope with a digest of its files (`adapters.AdapterDigests`). Without that state (the
middleware embedded in another app) the `model` and `cache` arguments must be given.

Environment: `KVGUARD_SALT_KEYRING_FILE`, `KVGUARD_DB_URL` (tenant keys and the policy store the
admin API writes, one database) and `KVGUARD_POLICY_FILE`: the middleware follows the store's
current version, re-read at most once a second (`POLICY_REFRESH_S`), so a tenant the admin
disables gets 403 within about a second; while the store holds no version, the file (or the
defaults) is in force. When the store cannot be read, requests get 503 until it can
(G7: no admission on a policy that may be stale).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

import anyio.to_thread
from sqlalchemy.exc import SQLAlchemyError

from kvguard.audit.ledger import Ledger
from kvguard.control.keys import TenantKeys
from kvguard.engine_adapter.vllm.adapters import AdapterDigests
from kvguard.engine_adapter.vllm.frontquota import (
    FrontQuota,
    QuotaRefusalError,
    Reservation,
    output_tokens,
)
from kvguard.engine_adapter.vllm.routes import RouteClass, classify, refusal, scope_route
from kvguard.engine_adapter.vllm.transport import ENVELOPE_KEY, Envelope
from kvguard.errors import ConfigError, KvguardError, PolicyError
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.salts import SaltDeriver
from kvguard.isolation.scope import (
    ID_MAX,
    AdapterRef,
    CacheConfig,
    ModelRef,
    Scope,
    Share,
    TokenizerRef,
)
from kvguard.logging import get_logger
from kvguard.policy import NO_USAGE, PolicySet, QuotaFull, admit, load_policy_file
from kvguard.policy.decisions import Reason
from kvguard.policy.store import PolicyStore

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

_log = get_logger("vllm.serve")
SESSION_HEADER: Final = b"x-kvguard-session"
SHARE_HEADER: Final = b"x-kvguard-share"
_SHARE_VALUES: Final = "tenant, session, group:<group id> or public"
_SHARING_HEADERS: Final = {SESSION_HEADER: "X-KVGuard-Session", SHARE_HEADER: "X-KVGuard-Share"}
# vLLM's /invocations copies this header into the body's `model` (SageMaker's LoRA convention)
# after the middleware has built the scope from the body: the middleware applies it itself, so the
# scope names the adapter that runs, and the engine never sees the header.
ADAPTER_HEADER: Final = b"x-amzn-sagemaker-adapter-identifier"
MAX_BODY: Final = 16 << 20
POLICY_REFRESH_S: Final = 1.0


class EngineView:
    """What the scope needs to know about the engine: model, tokenizer and cache configuration."""

    def __init__(self, model: ModelRef, tokenizer: TokenizerRef, cache: CacheConfig) -> None:
        self.model, self.tokenizer, self.cache = model, tokenizer, cache

    @classmethod
    def from_vllm_config(cls, config: Any) -> EngineView:
        """Read from vLLM's own `VllmConfig` (the same values the connector sees)."""
        mc, cc = config.model_config, config.cache_config
        revision = str(mc.revision or "main")
        return cls(
            ModelRef(id=str(mc.model), revision=revision),
            TokenizerRef(
                id=str(mc.tokenizer or mc.model), revision=str(mc.tokenizer_revision or revision)
            ),
            CacheConfig(kv_dtype=str(cc.cache_dtype), block_size=int(cc.block_size)),
        )


class KVGuardMiddleware:
    """See the module docstring. Keyword arguments override the environment (tests, embedding)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: TenantKeys | None = None,
        deriver: SaltDeriver | None = None,
        policies: PolicySet | None = None,
        model: ModelRef | None = None,
        cache: CacheConfig | None = None,
        policy_store: PolicyStore | None = None,
        ledger: Ledger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        env = os.environ
        self.app = app
        db_url = env.get("KVGUARD_DB_URL")
        self.keys = keys or TenantKeys.open(_required_env("KVGUARD_DB_URL"))
        self.deriver = deriver or SaltDeriver(
            Keyring.load(_required_env("KVGUARD_SALT_KEYRING_FILE"))
        )
        policy_file = env.get("KVGUARD_POLICY_FILE")
        self.policies = policies or (load_policy_file(policy_file) if policy_file else PolicySet())
        self.policy_store = policy_store or (PolicyStore.open(db_url) if db_url else None)
        self.policy_version: int | None = None
        self._clock = clock
        self._policy_read_at = float("-inf")
        self._engine: EngineView | None = None
        if model is not None and cache is not None:
            tokenizer = TokenizerRef(id=model.id, revision=model.revision)
            self._engine = EngineView(model, tokenizer, cache)
        self._adapters = AdapterDigests()
        self._quota = FrontQuota(self.deriver, ledger)  # quota.when_full: reject

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # no realtime route is governed: close before accept
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)  # lifespan
            return
        route = classify(str(scope.get("method", "")), scope_route(scope))
        if route is RouteClass.PUBLIC:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        tenant = await self._tenant(scope, send, headers)
        if tenant is None:
            return
        if route is RouteClass.READ:
            await self._read(scope, receive, send, tenant)
            return
        if route is RouteClass.REFUSED:
            await _reply(send, 403, refusal(str(scope.get("method", "")), scope_route(scope)))
            return
        await self._governed(scope, receive, send, tenant, headers)

    async def _read(
        self, scope: MutableMapping[str, Any], receive: Receive, send: Send, tenant: str
    ) -> None:
        """A route that reads no KV cache (model list, tokenizer): still refused to a tenant whose
        policy is disabled, as every route with a key is."""
        if not await anyio.to_thread.run_sync(self._refresh_policy):
            await _reply(send, 503, "policy unavailable")
            return
        if not self.policies.policy_for(tenant).enabled:
            await _reply(send, 403, f"refused by policy: {Reason.TENANT_DISABLED.value}")
            return
        if scope_route(scope) == "/v1/models":
            send = _models_without_paths(send)
        await self.app(scope, receive, send)

    async def _tenant(
        self, scope: MutableMapping[str, Any], send: Send, headers: dict[bytes, bytes]
    ) -> str | None:
        """The caller's tenant; None once the refusal (401, or 503 without the key store) is sent."""
        if sum(1 for name, _ in scope.get("headers") or [] if name == b"authorization") > 1:
            # Not resolved by picking one: vLLM and whatever sits in front must not disagree
            # with kvguard on who the caller is.
            await _reply(send, 401, "send one Authorization header, not several")
            return None
        try:
            # Database reads run on a worker thread: vLLM's event loop keeps streaming meanwhile.
            tenant = await anyio.to_thread.run_sync(
                self.keys.tenant_for, _bearer(headers.get(b"authorization"))
            )
        except SQLAlchemyError as exc:
            _log.warning("key store unreadable; refusing requests", error=type(exc).__name__)
            await _reply(send, 503, "kvguard cannot check API keys right now; retry later")
            return None
        if tenant is None:
            _log.info("request refused: invalid or missing API key", path=scope.get("path"))
            await _reply(send, 401, "invalid or missing API key")
        return tenant

    async def _governed(
        self,
        scope: MutableMapping[str, Any],
        receive: Receive,
        send: Send,
        tenant: str,
        headers: dict[bytes, bytes],
    ) -> None:
        try:
            rewritten, held = await self._admit_and_rewrite(scope, receive, tenant, headers)
        except _RefusedError as refusal:
            await _reply(send, refusal.status, refusal.message)
            return
        except QuotaRefusalError as refusal:
            await _reply(send, refusal.status, refusal.message, refusal.retry_after)
            return
        except _ClientGoneError:
            return  # nothing reached the engine; there is nobody to answer
        try:
            await self.app(_with_length(scope, len(rewritten)), _replay(rewritten, receive), send)
        finally:  # the response is sent, or the client is gone: the blocks are no longer held
            if held is not None:
                self._quota.release(held)

    async def _admit_and_rewrite(
        self,
        scope: MutableMapping[str, Any],
        receive: Receive,
        tenant: str,
        headers: dict[bytes, bytes],
    ) -> tuple[bytes, Reservation | None]:
        """The body the engine gets and the quota blocks held for it (`when_full: reject`);
        `_RefusedError` / `QuotaRefusalError` with the status to answer otherwise."""
        engine = self._engine_view(scope)
        if engine is None:
            raise _RefusedError(503, "kvguard cannot read the engine configuration")
        if not await anyio.to_thread.run_sync(self._refresh_policy):
            raise _RefusedError(503, "policy unavailable")
        body = await _read_body(receive)
        if body is None:
            raise _RefusedError(413, "request body too large")
        try:
            doc = _json_object(body)
            _refuse_engine_controls(doc)
            named = headers.get(ADAPTER_HEADER)
            if named and scope_route(scope) == "/invocations":
                doc["model"] = named.decode("latin-1")
            adapter = await anyio.to_thread.run_sync(self._adapter, scope, doc)  # reads files
        except ValueError as exc:
            raise _RefusedError(400, str(exc)) from None
        sharing = _requested_share(scope.get("headers") or [])
        request_scope = self._scope(tenant, sharing, engine, adapter)
        decision = admit(self.policies, request_scope, NO_USAGE)
        if not decision.admitted or decision.scope is None:
            raise _RefusedError(403, f"refused by policy: {decision.reason.value}")
        quota = self.policies.policy_for(tenant).quota
        if quota.max_blocks is None or quota.when_full is not QuotaFull.REJECT:
            route = scope_route(scope)
            self._check_quota(tenant, doc, engine.cache.block_size, route)
            return self._rewrite(doc, Envelope(decision.scope, decision.use_cache)), None
        held = await self._quota.hold(
            scope, tenant, doc, cap=quota.max_blocks, block_size=engine.cache.block_size
        )
        try:
            return self._rewrite(doc, Envelope(decision.scope, decision.use_cache)), held
        except BaseException:
            if held is not None:  # nothing reaches the engine: the blocks are not in use
                self._quota.release(held)
            raise

    def _check_quota(self, tenant: str, doc: dict[str, Any], block_size: int, route: str) -> None:
        """A request whose output alone needs more blocks than the tenant's quota can never fit:
        refuse it with a clear error here (the engine can only make requests wait). Prompt length is
        unknown before vLLM tokenizes, so this is the one quota check a front end can make."""
        cap = self.policies.policy_for(tenant).quota.max_blocks
        tokens = output_tokens(doc, route)
        if cap is None or tokens is None:
            return
        needed = -(-tokens // block_size)
        if needed > cap:
            raise _RefusedError(
                400,
                f"max_tokens {tokens} needs at least {needed} KV blocks of {block_size} tokens; "
                f"this tenant's quota is {cap} blocks",
            )

    def _engine_view(self, scope: MutableMapping[str, Any]) -> EngineView | None:
        if self._engine is None:
            state = getattr(scope.get("app"), "state", None)
            config = getattr(state, "vllm_config", None)
            if config is not None:
                self._engine = EngineView.from_vllm_config(config)
        return self._engine

    def _adapter(self, scope: MutableMapping[str, Any], doc: dict[str, Any]) -> AdapterRef | None:
        """The LoRA adapter the request names in `model`, with a digest of its files; None for the
        base model (or when the app serves no adapters)."""
        state = getattr(scope.get("app"), "state", None)
        models = getattr(state, "openai_serving_models", None)
        loras = getattr(models, "lora_requests", None) or {}
        name = doc.get("model")
        if not isinstance(name, str) or name not in loras:
            return None
        return self._adapters.ref(name, str(loras[name].lora_path))

    def _refresh_policy(self) -> bool:
        """Follow the policy store (at most once per POLICY_REFRESH_S); False if it cannot be read."""
        if self.policy_store is None:
            return True
        now = self._clock()
        if now - self._policy_read_at < POLICY_REFRESH_S:
            return True
        try:
            current = self.policy_store.current()
        except (SQLAlchemyError, PolicyError) as exc:
            _log.warning("policy store unreadable; refusing requests", error=type(exc).__name__)
            return False
        if current is not None and current.change.version != self.policy_version:
            self.policies, self.policy_version = current.policy, current.change.version
            _log.info("policy version in force", version=self.policy_version)
        self._policy_read_at = now
        return True

    def _scope(
        self,
        tenant: str,
        share: SharedUnit,
        engine: EngineView | None = None,
        adapter: AdapterRef | None = None,
    ) -> Scope:
        view = engine or self._engine
        if view is None:
            raise KvguardError("the engine configuration is not known yet")
        return Scope(
            tenant_id=tenant,
            share=share.share,
            session_id=share.session,
            group_id=share.group,
            model=view.model,
            tokenizer=view.tokenizer,
            adapter=adapter,
            cache_config=view.cache,
            policy_epoch=self.policies.epoch,
        )

    def _rewrite(self, doc: dict[str, Any], envelope: Envelope) -> bytes:
        # Never trust a client salt (G1): whatever it sent is overwritten.
        doc["cache_salt"] = (
            self.deriver.salt(envelope.scope)
            if envelope.use_cache
            else "nocache:" + secrets.token_urlsafe(16)
        )
        existing = doc.get("vllm_xargs")
        xargs: dict[str, Any] = existing if isinstance(existing, dict) else {}
        doc["vllm_xargs"] = {**xargs, ENVELOPE_KEY: envelope.to_json()}
        return json.dumps(doc).encode()


class _ClientGoneError(Exception):
    """The client disconnected before its body was complete."""


class _RefusedError(Exception):
    """Answer the request with this status and message; the engine never sees it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(
            f"{name} is not set: `kvguard engine serve` sets it; when mounting KVGuardMiddleware "
            "yourself, set KVGUARD_DB_URL and KVGUARD_SALT_KEYRING_FILE (docs/vllm.md)"
        )
    return value


# Fields through which a client would steer vLLM's own machinery rather than its request: KV
# transfer parameters (vLLM reports a client's `remote_prefill_cached_tokens` as the request's
# cached tokens, G1's observable; a malformed value is a 500 in its output processor) and the
# `extra_args` keys vLLM reads itself. kvguard's own envelope is overwritten, never refused.
_ENGINE_FIELDS: Final = ("kv_transfer_params", "ec_transfer_params")
_ENGINE_XARGS: Final = frozenset({*_ENGINE_FIELDS, "kv_cache_report_mode"})


@dataclass(frozen=True, slots=True)
class SharedUnit:
    """The sharing unit a request asks for; `admit` narrows it to what the tenant's policy allows."""

    share: Share
    session: str | None = None
    group: str | None = None


TENANT_UNIT: Final = SharedUnit(Share.TENANT)


def _requested_share(raw: Iterable[tuple[bytes, bytes]]) -> SharedUnit:
    """`X-KVGuard-Session` and `X-KVGuard-Share` (from the request's raw header list) as a sharing
    unit; `_RefusedError` (400) naming the header when one is repeated, malformed or contradicts the
    other. A repeated header is not resolved by picking one: a proxy that sets `X-KVGuard-Share:
    tenant` must not be overridden by a client's header after it. The share keyword is read
    case-insensitively, the group id less surrounding spaces, the session id as sent. Values are
    never echoed: a header is no place for a prompt, but a client may put one there."""
    found: dict[bytes, str] = {}
    for name, value in raw:
        if name in _SHARING_HEADERS:
            if name in found:
                raise _RefusedError(400, f"send one {_SHARING_HEADERS[name]} header, not several")
            found[name] = value.decode("latin-1")
    session = found.get(SESSION_HEADER) or None
    keyword, colon, group = found.get(SHARE_HEADER, "").partition(":")
    keyword, group = keyword.strip().lower(), group.strip()
    if session is not None and not (1 <= len(session) <= ID_MAX and session.strip()):
        raise _RefusedError(
            400, f"invalid X-KVGuard-Session header (1-{ID_MAX} characters, not only spaces)"
        )
    if keyword in ("", "session") and not colon and session is not None:
        return SharedUnit(Share.SESSION, session=session)
    if keyword == "session" and not colon:
        raise _RefusedError(400, "X-KVGuard-Share: session needs an X-KVGuard-Session header")
    if session is not None:
        raise _RefusedError(
            400, "X-KVGuard-Session names a session: X-KVGuard-Share may only be 'session' with it"
        )
    if keyword in ("", "tenant") and not colon:
        return TENANT_UNIT
    if keyword == "public" and not colon:
        return SharedUnit(Share.PUBLIC)
    if keyword == "group" and colon and 1 <= len(group) <= ID_MAX:
        return SharedUnit(Share.GROUP, group=group)
    raise _RefusedError(
        400, f"invalid X-KVGuard-Share header: expected {_SHARE_VALUES} (ids 1-{ID_MAX} characters)"
    )


def _refuse_engine_controls(doc: dict[str, Any]) -> None:
    """ValueError (400) for a body that asks for what kvguard cannot govern: beam search (vLLM
    builds a new SamplingParams for every beam step without the request's `extra_args`, so each
    step would run outside the tenant's scope and policy) and engine-internal parameters."""
    if doc.get("use_beam_search"):
        raise ValueError(
            "use_beam_search is not served through kvguard: vLLM's beam search drops the "
            "request's tenant scope"
        )
    for name in _ENGINE_FIELDS:
        if doc.get(name) is not None:
            raise ValueError(f"{name} is set by the serving engine, not by clients")
    xargs = doc.get("vllm_xargs")
    reserved = sorted(_ENGINE_XARGS & xargs.keys()) if isinstance(xargs, dict) else []
    if reserved:
        raise ValueError(f"vllm_xargs.{reserved[0]} is set by the serving engine, not by clients")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body) if body else None
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        doc = None
    if not isinstance(doc, dict):
        raise ValueError("request body must be a JSON object")
    return doc


def _bearer(value: bytes | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGoneError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The rewritten body once, then the real connection: a client disconnect reaches the app."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _with_length(scope: MutableMapping[str, Any], length: int) -> MutableMapping[str, Any]:
    """The request as the engine gets it: the rewritten body's length, no adapter header."""
    dropped = (b"content-length", ADAPTER_HEADER)
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() not in dropped]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


def _models_without_paths(send: Send) -> Send:
    """`send` for `GET /v1/models`, with each model card's `root` (vLLM puts the base model's path
    and each LoRA adapter's directory there: the server's file system, not the tenants' business)
    replaced by the card's own `id`. The answer is small and sent whole; it is held until its
    last part, rewritten, and its length set again. A body that is not a model list passes as it
    is."""
    start: dict[str, Any] = {}
    parts: list[bytes] = []

    async def rewritten(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
            return
        if message["type"] != "http.response.body" or not start:
            await send(message)
            return
        parts.append(bytes(message.get("body", b"")))
        if message.get("more_body", False):
            return
        body = _card_roots_as_ids(b"".join(parts))
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return rewritten


def _card_roots_as_ids(body: bytes) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list):
        return body
    for card in cards:
        if isinstance(card, dict) and "root" in card:
            card["root"] = card.get("id")
    return json.dumps(doc).encode()


async def _reply(send: Send, status: int, message: str, retry_after: int | None = None) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
