"""ASGI middleware that puts kvguard in front of vLLM's OpenAI-compatible server (`vllm serve`).

For every `/v1/...` request it:
1. maps `Authorization: Bearer <key>` to a tenant through the tenant registry (`TenantKeys`); a
   missing, unknown or revoked key gets 401 before the body is read, so no engine work happens;
2. asks policy (`admit`) for the tenant's scope (optional `X-KVGuard-Session` header for session
   scope); a refused request (a disabled tenant, say) gets 403;
3. on JSON request bodies, drops any client `cache_salt`, sets the salt derived by the server, and adds
   the scope envelope to `vllm_xargs`, which vLLM turns into the request's `extra_args` for the
   connector to check (G1).

Mounting: `vllm serve MODEL --middleware kvguard.engine_adapter.vllm.serve.KVGuardMiddleware` with the
connector configured as in docs/vllm.md and these environment variables: `KVGUARD_SALT_KEYRING_FILE`,
`KVGUARD_DB_URL` (the tenant registry), `KVGUARD_POLICY_FILE`, `KVGUARD_MODEL_ID` (the name vLLM serves
the model under), `KVGUARD_MODEL_REVISION`, `KVGUARD_BLOCK_SIZE`, `KVGUARD_KV_DTYPE`, and
`KVGUARD_POLICY_URL` (the policy store the admin API writes): with it, the middleware follows the
store's current version, re-read at most once a second (`POLICY_REFRESH_S`), so a tenant the admin
disables gets 403 within about a second; `KVGUARD_POLICY_FILE` then only applies while the store holds
no version. When the store cannot be read, requests get 503 until it can (G7: no admission on a policy
that may be stale).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from sqlalchemy.exc import SQLAlchemyError

from kvguard.engine_adapter.tenant_keys import TenantKeys
from kvguard.engine_adapter.vllm.transport import ENVELOPE_KEY, Envelope
from kvguard.errors import PolicyError
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.salts import SaltDeriver
from kvguard.isolation.scope import CacheConfig, ModelRef, Scope, Share, TokenizerRef
from kvguard.logging import get_logger
from kvguard.policy import PolicySet, Usage, admit, load_policy_file
from kvguard.policy.store import PolicyStore

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

_log = get_logger("vllm.serve")
SESSION_HEADER = b"x-kvguard-session"
MAX_BODY = 16 << 20
POLICY_REFRESH_S: Final = 1.0


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        env = os.environ
        self.app = app
        self.keys = keys or TenantKeys.open(env["KVGUARD_DB_URL"])
        self.deriver = deriver or SaltDeriver(Keyring.load(env["KVGUARD_SALT_KEYRING_FILE"]))
        policy_file = env.get("KVGUARD_POLICY_FILE")
        self.policies = policies or (load_policy_file(policy_file) if policy_file else PolicySet())
        policy_url = env.get("KVGUARD_POLICY_URL")
        self.policy_store = policy_store or (PolicyStore.open(policy_url) if policy_url else None)
        self.policy_version: int | None = None
        self._clock = clock
        self._policy_read_at = float("-inf")
        self.model = model or ModelRef(
            id=env["KVGUARD_MODEL_ID"], revision=env.get("KVGUARD_MODEL_REVISION", "main")
        )
        self.tokenizer = TokenizerRef(id=self.model.id, revision=self.model.revision)
        self.cache = cache or CacheConfig(
            kv_dtype=env.get("KVGUARD_KV_DTYPE", "auto"),
            block_size=int(env.get("KVGUARD_BLOCK_SIZE", "16")),
        )

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        tenant = self.keys.tenant_for(_bearer(headers.get(b"authorization")))
        if tenant is None:
            _log.info("request refused: invalid or missing API key", path=scope.get("path"))
            await _reply(send, 401, "invalid or missing API key")
            return
        if not self._refresh_policy():
            await _reply(send, 503, "policy unavailable")
            return
        session = headers.get(SESSION_HEADER, b"").decode("latin-1") or None
        request_scope = self._scope(tenant, session)
        decision = admit(self.policies, request_scope, Usage())
        if not decision.admitted or decision.scope is None:
            await _reply(send, 403, f"refused by policy: {decision.reason.value}")
            return
        body = await _read_body(receive)
        if body is None:
            await _reply(send, 413, "request body too large")
            return
        try:
            rewritten = self._rewrite(body, Envelope(decision.scope, decision.use_cache))
        except ValueError:
            await _reply(send, 400, "request body must be a JSON object")
            return
        await self.app(_with_length(scope, len(rewritten)), _replay(rewritten), send)

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

    def _scope(self, tenant: str, session: str | None) -> Scope:
        return Scope(
            tenant_id=tenant,
            share=Share.SESSION if session else Share.TENANT,
            session_id=session,
            model=self.model,
            tokenizer=self.tokenizer,
            cache_config=self.cache,
            policy_epoch=self.policies.epoch,
        )

    def _rewrite(self, body: bytes, envelope: Envelope) -> bytes:
        if not body:
            return body
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
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
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _with_length(scope: MutableMapping[str, Any], length: int) -> MutableMapping[str, Any]:
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
