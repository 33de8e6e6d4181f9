"""The serve middleware in isolation: API key -> tenant, deny by default, client salts stripped,
server salt and scope injected, the connection passed through. (The same middleware in front of the
real vLLM server, with the openai client: test_openai_server.py.)"""

from __future__ import annotations

import json
import os
import time
import uuid

import httpx
import pytest
import sqlalchemy as sa

from kvguard.control.keys import TenantKeys
from kvguard.control.tenants import TenantRegistry
from kvguard.engine_adapter.vllm.serve import TENANT_UNIT, KVGuardMiddleware
from kvguard.engine_adapter.vllm.transport import Envelope, read_envelope
from kvguard.isolation import CacheConfig, Keyring, ModelRef, SaltDeriver, Share
from kvguard.policy import PolicySet, TenantPolicy, prefix_digest


class Downstream:
    """Stands in for vLLM's app: records what reached it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        if scope["path"] != "/health":
            self.bodies.append(json.loads(message.get("body") or b"{}"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


# The engine every middleware here stands in front of: its model and cache config.
TINY_ENGINE: dict = {
    "model": ModelRef(id="tiny", revision="1"),
    "cache": CacheConfig(kv_dtype="auto", block_size=32),
}
PG_URL = os.environ.get("KVGUARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _registered(keys: TenantKeys, *tenants: str) -> TenantKeys:
    registry = TenantRegistry(keys._engine)
    for tenant in tenants:
        registry.create(tenant, display_name=tenant, created_by="test")
    return keys


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def tenant_keys(request, tmp_path):
    if request.param == "sqlite":
        yield _registered(TenantKeys.open(f"sqlite:///{tmp_path / 'tenants.db'}"), "acme", "off")
        return
    schema = f"tk_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL unreachable at {PG_URL} ({type(exc).__name__})")
    engine = sa.create_engine(PG_URL, connect_args={"options": f"-csearch_path={schema}"})
    try:
        yield _registered(TenantKeys(engine), "acme", "off")
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def setup(tenant_keys):
    keys = tenant_keys
    deriver = SaltDeriver(Keyring.generate())
    policies = PolicySet(tenants={"off": TenantPolicy(enabled=False)})
    downstream = Downstream()
    app = KVGuardMiddleware(
        downstream,
        keys=keys,
        deriver=deriver,
        policies=policies,
        **TINY_ENGINE,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvguard")
    return keys, deriver, downstream, client


def _served(keys: TenantKeys, policies: PolicySet) -> tuple[Downstream, httpx.AsyncClient]:
    """The middleware in front of a recording app, under `policies`."""
    downstream = Downstream()
    app = KVGuardMiddleware(
        downstream,
        keys=keys,
        deriver=SaltDeriver(Keyring.generate()),
        policies=policies,
        **TINY_ENGINE,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvguard")
    return downstream, client


async def _post(client, key, body, headers=None):
    h = {"authorization": f"Bearer {key}"} if key else {}
    return await client.post("/v1/completions", json=body, headers={**h, **(headers or {})})


@pytest.mark.anyio
async def test_missing_unknown_or_revoked_key_is_401_without_engine_work(setup) -> None:
    keys, _, downstream, client = setup
    issued = keys.issue("acme")
    forged = issued.api_key[:-4] + "AAAA"
    for key in (None, "nonsense", forged, "kvg_000000000000_" + "A" * 43):
        response = await _post(client, key, {"prompt": [1, 2, 3]})
        assert response.status_code == 401
        assert issued.api_key not in response.text
    keys.revoke(issued.key_id)
    assert (await _post(client, issued.api_key, {"prompt": [1]})).status_code == 401
    assert downstream.bodies == []


@pytest.mark.anyio
async def test_G1_client_salt_replaced_by_server_salt_and_envelope(setup) -> None:
    keys, deriver, downstream, client = setup
    key = keys.issue("acme").api_key
    response = await _post(
        client, key, {"prompt": [1, 2, 3], "cache_salt": "victim-salt", "vllm_xargs": {"mine": 1}}
    )
    assert response.status_code == 200
    body = downstream.bodies[-1]
    envelope = read_envelope(body["vllm_xargs"])
    assert envelope is not None and envelope.scope.tenant_id == "acme"
    assert body["cache_salt"] == deriver.salt(envelope.scope) != "victim-salt"
    assert body["vllm_xargs"]["mine"] == 1
    await _post(client, key, {"prompt": [1]}, {"x-kvguard-session": "s1"})
    session = read_envelope(downstream.bodies[-1]["vllm_xargs"])
    assert session.scope.share is Share.SESSION and session.scope.session_id == "s1"


@pytest.mark.anyio
async def test_disabled_tenant_403_and_bad_body_400(setup) -> None:
    keys, _, downstream, client = setup
    assert (await _post(client, keys.issue("off").api_key, {"prompt": [1]})).status_code == 403
    response = await client.post(
        "/v1/completions",
        content=b"[1, 2",
        headers={"authorization": f"Bearer {keys.issue('acme').api_key}"},
    )
    assert response.status_code == 400
    assert downstream.bodies == []


@pytest.mark.anyio
async def test_deny_by_default_only_health_is_public(setup) -> None:
    keys, _, downstream, client = setup
    assert (await client.get("/health")).status_code == 200
    key = {"authorization": f"Bearer {keys.issue('acme').api_key}"}
    for method, path in [
        ("GET", "/metrics"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/v1/load_lora_adapter"),
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/inference/v1/generate"),
        ("GET", "/openapi.json"),
        ("POST", "/some/future/route"),
    ]:
        assert (await client.request(method, path)).status_code == 401, path
        refused = await client.request(method, path, headers=key)
        assert refused.status_code == 403 and "not served" in refused.text, path
    assert (await client.get("/v1/models", headers=key)).status_code == 200  # read-only, keyed
    assert (await client.get("/v1/models")).status_code == 401
    assert downstream.bodies == [{}]  # only /v1/models reached the app


def test_keys_only_for_registered_enabled_tenants_and_listing_hides_secrets(tenant_keys) -> None:
    from kvguard.errors import ConflictError, NotFoundError  # noqa: PLC0415

    with pytest.raises(NotFoundError):
        tenant_keys.issue("nobody")
    issued = tenant_keys.issue("acme")
    listed = tenant_keys.list("acme")
    assert [k.key_id for k in listed] == [issued.key_id] and not listed[0].revoked
    assert issued.api_key not in repr(listed)
    assert tenant_keys.revoke(issued.key_id, tenant_id="acme").revoked
    with pytest.raises(NotFoundError):  # another tenant's key cannot be revoked through "off"
        tenant_keys.revoke(issued.key_id, tenant_id="off")
    TenantRegistry(tenant_keys._engine).disable("off", by="admin", reason="test")
    with pytest.raises(ConflictError):
        tenant_keys.issue("off")


@pytest.mark.anyio
async def test_client_disconnect_reaches_the_app_after_the_body(setup) -> None:
    keys, _, _, _ = setup
    seen: list[str] = []

    async def app(scope, receive, send):
        seen.append((await receive())["type"])
        seen.append((await receive())["type"])  # vLLM's with_cancellation waits on this
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = KVGuardMiddleware(
        app,
        keys=keys,
        deriver=SaltDeriver(Keyring.generate()),
        policies=PolicySet(),
        **TINY_ENGINE,
    )
    body = json.dumps({"prompt": [1, 2]}).encode()
    incoming = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.request", "body": body[5:], "more_body": False},
        {"type": "http.disconnect"},
    ]

    async def receive():
        return incoming.pop(0)

    async def send(message):
        return None

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"authorization", f"Bearer {keys.issue('acme').api_key}".encode())],
    }
    await middleware(scope, receive, send)
    assert seen == ["http.request", "http.disconnect"]


@pytest.mark.anyio
async def test_scope_comes_from_the_engines_own_config(tenant_keys) -> None:
    """Block size, dtype, model and revision are read from `app.state.vllm_config`."""
    from types import SimpleNamespace  # noqa: PLC0415

    downstream = Downstream()
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            model="org/model", revision="abc", tokenizer="org/model", tokenizer_revision=None
        ),
        cache_config=SimpleNamespace(cache_dtype="fp8", block_size=128),
    )
    app = KVGuardMiddleware(
        downstream, keys=tenant_keys, deriver=SaltDeriver(Keyring.generate()), policies=PolicySet()
    )
    state_app = SimpleNamespace(state=SimpleNamespace(vllm_config=config))
    key = tenant_keys.issue("acme").api_key

    async def wrapped(scope, receive, send):
        await app({**scope, "app": state_app}, receive, send)

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://k")
    assert (await _post(client, key, {"prompt": [1]})).status_code == 200
    scope = read_envelope(downstream.bodies[-1]["vllm_xargs"]).scope
    assert (scope.cache_config.block_size, scope.cache_config.kv_dtype) == (128, "fp8")
    assert (scope.model.id, scope.model.revision) == ("org/model", "abc")
    bare = KVGuardMiddleware(
        Downstream(),
        keys=tenant_keys,
        deriver=SaltDeriver(Keyring.generate()),
        policies=PolicySet(),
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=bare), base_url="http://k")
    response = await _post(client, key, {"prompt": [1]})
    assert response.status_code == 503 and "engine configuration" in response.text


def test_envelope_survives_vllms_openai_protocol(setup) -> None:
    """The rewritten body, parsed by vLLM's own request model, yields extra_args the connector reads."""
    protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    _, deriver, _, _ = setup
    app = KVGuardMiddleware(
        Downstream(),
        keys=setup[0],
        deriver=deriver,
        policies=PolicySet(),
        **TINY_ENGINE,
    )
    scope = app._scope("acme", TENANT_UNIT)
    body = json.loads(app._rewrite({"model": "tiny", "prompt": [1, 2]}, Envelope(scope, True)))
    request = protocol.CompletionRequest.model_validate(body)
    params = request.to_sampling_params(max_tokens=4)
    assert read_envelope(params.extra_args).scope == scope
    assert request.cache_salt == deriver.salt(scope)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.anyio
async def test_disabled_in_the_policy_store_is_403_within_a_refresh(tmp_path, monkeypatch) -> None:
    from kvguard.policy.store import PolicyStore  # noqa: PLC0415

    keys = _registered(TenantKeys.open(f"sqlite:///{tmp_path / 'tenants.db'}"), "acme")
    store = PolicyStore.open(f"sqlite:///{tmp_path / 'policy.db'}")
    clock = _Clock()
    downstream = Downstream()
    app = KVGuardMiddleware(
        downstream,
        keys=keys,
        deriver=SaltDeriver(Keyring.generate()),
        policies=PolicySet(
            tenants={"acme": TenantPolicy(enabled=False)}
        ),  # until the store has one
        **TINY_ENGINE,
        policy_store=store,
        clock=clock,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvguard")
    key = keys.issue("acme").api_key
    assert (await _post(client, key, {"prompt": [1]})).status_code == 403  # the file policy
    store.put(PolicySet(epoch=3), author="admin", reason="enable acme")
    clock.now = 1.0
    assert (await _post(client, key, {"prompt": [1]})).status_code == 200
    assert read_envelope(downstream.bodies[-1]["vllm_xargs"]).scope.policy_epoch == 3
    store.put(
        PolicySet(epoch=3, tenants={"acme": TenantPolicy(enabled=False)}), author="a", reason="b"
    )
    clock.now = 1.5  # read at most once a second: the old version still holds
    assert (await _post(client, key, {"prompt": [1]})).status_code == 200
    clock.now = 2.0
    response = await _post(client, key, {"prompt": [1]})
    assert response.status_code == 403 and "tenant_disabled" in response.text
    assert app.policy_version == 2 and len(downstream.bodies) == 2

    def unreadable():
        raise sa.exc.OperationalError("SELECT policy_versions", {}, Exception("unreachable"))

    monkeypatch.setattr(store, "current", unreadable)
    clock.now = 3.0  # the store cannot be read: refuse rather than admit on a stale policy (G7)
    assert (await _post(client, key, {"prompt": [1]})).status_code == 503
    assert len(downstream.bodies) == 2
    store.engine.dispose()


@pytest.mark.anyio
async def test_a_request_that_can_never_fit_the_quota_is_a_clear_400(tenant_keys) -> None:
    downstream = Downstream()
    app = KVGuardMiddleware(
        downstream,
        keys=tenant_keys,
        deriver=SaltDeriver(Keyring.generate()),
        policies=PolicySet.model_validate({"tenants": {"acme": {"quota": {"max_blocks": 4}}}}),
        **TINY_ENGINE,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://k")
    key = tenant_keys.issue("acme").api_key
    refused = await _post(client, key, {"prompt": [1], "max_tokens": 129})  # 5 blocks > 4
    assert refused.status_code == 400 and "quota is 4 blocks" in refused.text
    assert (await _post(client, key, {"prompt": [1], "max_tokens": 128})).status_code == 200
    assert len(downstream.bodies) == 1


@pytest.mark.anyio
async def test_key_store_outage_is_503_and_key_reads_do_not_block_the_loop(
    setup, monkeypatch
) -> None:
    """The key check runs on a worker thread: while it waits on the database, the event loop (vLLM's
    streams) keeps running. A key store that cannot be read is a 503, never a 500 or a pass."""
    import asyncio  # noqa: PLC0415

    keys, _, downstream, client = setup
    issued = keys.issue("acme")
    real = keys.tenant_for

    def slow(key):
        time.sleep(0.4)
        return real(key)

    monkeypatch.setattr(keys, "tenant_for", slow)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    response = await _post(client, issued.api_key, {"prompt": [1]})
    seen = ticks  # how far the loop got while the key check waited 0.4 s
    task.cancel()
    assert response.status_code == 200 and seen >= 10
    assert len(downstream.bodies) == 1

    def down(_key):
        raise sa.exc.OperationalError("SELECT", {}, Exception("connection refused"))

    monkeypatch.setattr(keys, "tenant_for", down)
    response = await _post(client, issued.api_key, {"prompt": [1]})
    assert response.status_code == 503 and "retry" in response.text
    assert len(downstream.bodies) == 1


@pytest.mark.anyio
async def test_share_header_asks_for_a_group_or_public_scope_and_policy_narrows_it(
    tenant_keys,
) -> None:
    """docs/vllm.md "Sharing": `X-KVGuard-Share: group:<id>` or `public` asks for a wider scope on
    the served path; `admit` keeps it only where the tenant's policy allows it (a member of the
    group with `reuse: group`), and narrows it to the tenant otherwise."""
    digest = prefix_digest(list(range(1, 65)))
    policies = PolicySet.model_validate(
        {
            "share_groups": {"docs": {"prefixes": [{"id": "sys/v1", "digest": digest}]}},
            "tenants": {"acme": {"reuse": "group", "groups": ["docs"]}},
        }
    )
    downstream, client = _served(tenant_keys, policies)
    acme, off = tenant_keys.issue("acme").api_key, tenant_keys.issue("off").api_key

    async def scope_of(key: str, headers: dict[str, str]):
        response = await _post(client, key, {"prompt": [1]}, headers)
        assert response.status_code == 200, response.text
        return read_envelope(downstream.bodies[-1]["vllm_xargs"]).scope

    grouped = await scope_of(acme, {"x-kvguard-share": "group:docs"})
    assert (grouped.share, grouped.group_id) == (Share.GROUP, "docs")
    for asked in ("group:other", "public", "tenant"):  # not a member / wider than `reuse: group`
        narrowed = await scope_of(acme, {"x-kvguard-share": asked})
        assert (narrowed.share, narrowed.group_id) == (Share.TENANT, None), asked
    session = await scope_of(acme, {"x-kvguard-share": "session", "x-kvguard-session": "s1"})
    assert (session.share, session.session_id) == (Share.SESSION, "s1")
    # `off` is disabled by no policy here: a tenant outside the group asking for it gets its own.
    assert (await scope_of(off, {"x-kvguard-share": "group:docs"})).share is Share.TENANT


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "names"),
    [
        ({"x-kvguard-share": "everyone-secret-prompt"}, "X-KVGuard-Share"),
        ({"x-kvguard-share": "group:"}, "X-KVGuard-Share"),
        ({"x-kvguard-share": "group:" + "g" * 257}, "X-KVGuard-Share"),
        ({"x-kvguard-share": "session"}, "X-KVGuard-Session"),
        ({"x-kvguard-share": "group:docs", "x-kvguard-session": "s1"}, "X-KVGuard-Share"),
        ({"x-kvguard-session": "s" * 257}, "X-KVGuard-Session"),
        ({"x-kvguard-session": "   "}, "X-KVGuard-Session"),
        ({"x-kvguard-share": "group:   "}, "X-KVGuard-Share"),
        ({"x-kvguard-share": "session:x"}, "X-KVGuard-Share"),
    ],
)
async def test_a_malformed_or_contradictory_share_header_is_400_without_engine_work(
    setup, headers, names
) -> None:
    keys, _, downstream, client = setup
    response = await _post(client, keys.issue("acme").api_key, {"prompt": [1]}, headers)
    assert response.status_code == 400
    assert names in response.text
    assert "secret-prompt" not in response.text and "ggggg" not in response.text
    assert downstream.bodies == []


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["x-kvguard-share", "x-kvguard-session"])
async def test_a_repeated_sharing_header_is_400_not_the_last_one_wins(setup, name) -> None:
    """A proxy that sets `X-KVGuard-Share: tenant` must not be overridden by a client's own header
    after it (ASGI keeps both; a dict of them keeps the last)."""
    keys, _, downstream, client = setup
    key = keys.issue("acme").api_key
    value = "tenant" if name == "x-kvguard-share" else "s1"
    response = await client.post(
        "/v1/completions",
        json={"prompt": [1]},
        headers=[("authorization", f"Bearer {key}"), (name, value), (name, value)],
    )
    assert response.status_code == 400
    assert "not several" in response.text
    assert downstream.bodies == []


@pytest.mark.anyio
async def test_the_share_keyword_is_read_case_insensitively_ids_as_sent(tenant_keys) -> None:
    policies = PolicySet.model_validate(
        {
            "share_groups": {"Docs": {"prefixes": [{"id": "p", "digest": prefix_digest([1])}]}},
            "tenants": {"acme": {"reuse": "group", "groups": ["Docs"]}},
        }
    )
    downstream, client = _served(tenant_keys, policies)
    key = tenant_keys.issue("acme").api_key
    cases = (("GROUP:Docs", "Docs"), (" Group : Docs ", "Docs"), ("group:docs", None))
    for asked, group in cases:
        response = await _post(client, key, {"prompt": [1]}, {"x-kvguard-share": asked})
        assert response.status_code == 200, response.text
        scope = read_envelope(downstream.bodies[-1]["vllm_xargs"]).scope
        assert scope.group_id == group, asked  # `docs` is no group of acme's: narrowed


@pytest.mark.anyio
async def test_routes_behind_a_root_path_are_classified_as_the_router_dispatches(
    tenant_keys,
) -> None:
    """vLLM's `--root-path` behind a proxy that keeps the prefix: the middleware classified the raw
    path, so every route was refused, health probes included (found by a review). It classifies
    the path the router dispatches (less `root_path`); what is refused stays refused."""
    from fastapi import FastAPI  # noqa: PLC0415

    api = FastAPI(root_path="/api")
    reached: list[str] = []

    @api.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @api.post("/v1/completions")
    async def completions(body: dict) -> dict:
        reached.append("completions")
        return {"salted": "cache_salt" in body}

    @api.post("/reset_prefix_cache")
    async def reset() -> dict:  # a route kvguard refuses
        reached.append("reset")
        return {}

    api.add_middleware(
        KVGuardMiddleware,
        keys=tenant_keys,
        deriver=SaltDeriver(Keyring.generate()),
        policies=PolicySet(),
        **TINY_ENGINE,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://kvguard")
    key = {"authorization": f"Bearer {tenant_keys.issue('acme').api_key}"}
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    assert (await client.get("/api/health")).status_code == 200
    assert (await client.post("/api/v1/completions", json=body)).status_code == 401
    served = await client.post("/api/v1/completions", json=body, headers=key)
    assert served.status_code == 200 and served.json() == {"salted": True}
    refused = await client.post("/api/reset_prefix_cache", headers=key)
    assert refused.status_code == 403 and "not served" in refused.text
    assert (await client.post("/apix/v1/completions", json=body, headers=key)).status_code == 403
    assert reached == ["completions"]
