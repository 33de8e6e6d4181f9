"""Issue 10, item 6: `quota.when_full: reject`. The middleware counts the blocks a request needs
(prompt + max_tokens, per sequence), holds them against the tenant's quota while the request is in
flight, and refuses what would pass it: 429 with Retry-After and the figures, a `quota.reject`
ledger entry under the tenant's tag; 400 for a request that can never fit. Tenants with
`when_full: wait` (the default) and other tenants are untouched. (Against the real vLLM server:
tests/engine_adapter/test_openai_server.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.control.keys import TenantKeys
from kvguard.control.tenants import TenantRegistry
from kvguard.engine_adapter.vllm.frontquota import InFlight, blocks_needed, prompt_tokens
from kvguard.engine_adapter.vllm.serve import KVGuardMiddleware
from kvguard.isolation import CacheConfig, Keyring, ModelRef, SaltDeriver
from kvguard.policy import PolicySet

POLICY = {
    "tenants": {
        "acme": {"quota": {"max_blocks": 4, "when_full": "reject"}},
        "globex": {"quota": {"max_blocks": 4}},  # when_full: wait (the engine makes it wait)
    }
}


class Held:
    """Stands in for vLLM's app: a request marked `hold` stays in flight until released; one
    marked `fail` fails."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.reached: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.reached.append(json.loads(message.get("body") or b"{}"))
        if self.reached[-1].get("fail"):
            raise RuntimeError("the engine failed this request")
        if self.reached[-1].get("hold"):
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def app(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    keys = TenantKeys.open(url)
    registry = TenantRegistry(keys._engine)
    for tenant in ("acme", "globex"):
        registry.create(tenant, display_name=tenant, created_by="test")
    deriver = SaltDeriver(Keyring.generate())
    ledger = Ledger.open(url, origin="kvguard.test/ledger", signing_key=SigningKey.generate("t"))
    held = Held()
    middleware = KVGuardMiddleware(
        held,
        keys=keys,
        deriver=deriver,
        policies=PolicySet.model_validate(POLICY),
        model=ModelRef(id="tiny", revision="1"),
        cache=CacheConfig(kv_dtype="auto", block_size=32),
        ledger=ledger,
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://k")
    yield {t: keys.issue(t).api_key for t in ("acme", "globex")}, held, client, ledger, deriver
    ledger.close()


async def _post(client, key, body):
    return await client.post(
        "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )


def test_blocks_needed_counts_prompt_output_and_sequences() -> None:
    assert blocks_needed({"max_tokens": 50}, 40, 0, 32) == 3
    assert blocks_needed({"max_tokens": 50, "n": 2}, 40, 0, 32) == 6
    assert blocks_needed({}, 40, 2048, 32) == 64  # vLLM fills max_tokens up to the model length
    # Each route's own output field: /v1/responses reads `max_output_tokens` (max_tokens is not
    # one of its fields), pooling routes generate nothing.
    assert blocks_needed({"max_output_tokens": 8}, 40, 2048, 32, "/v1/responses") == 2
    assert blocks_needed({"max_tokens": 8}, 40, 2048, 32, "/v1/responses") == 64
    assert blocks_needed({"max_tokens": 50}, 40, 2048, 32, "/v1/embeddings") == 2
    assert blocks_needed({}, 0, 2048, 32, "/pooling") == 1
    flight = InFlight()
    first = flight.take("a", 3, 4)
    assert first is not None and flight.take("a", 2, 4) is None and flight.held("a") == 3
    flight.release(first)
    assert flight.held("a") == 0


@pytest.mark.anyio
async def test_a_full_quota_refuses_with_429_records_it_and_frees_when_requests_end(app) -> None:
    keys, held, client, ledger, deriver = app
    async with anyio.create_task_group() as tg:
        results: dict[str, httpx.Response] = {}

        async def first() -> None:  # 40 + 50 tokens: 3 blocks of 32, held while in flight
            results["first"] = await _post(
                client, keys["acme"], {"prompt": [7] * 40, "max_tokens": 50, "hold": True}
            )

        tg.start_soon(first)
        while not held.reached:
            await anyio.sleep(0.01)
        refused = await _post(client, keys["acme"], {"prompt": [7] * 10, "max_tokens": 30})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        message = refused.json()["error"]["message"]
        assert "hold 3 of its 4 KV blocks" in message and "needs 2" in message
        # another tenant, and a tenant whose policy says wait, are untouched
        other = await _post(client, keys["globex"], {"prompt": [7] * 10, "max_tokens": 30})
        assert other.status_code == 200
        held.release.set()
    assert results["first"].status_code == 200
    again = await _post(client, keys["acme"], {"prompt": [7] * 10, "max_tokens": 30})
    assert again.status_code == 200  # the first request's blocks were released
    assert len(held.reached) == 3  # the refused request never reached the engine
    ledger.flush()
    entries = ledger.query(kinds=["quota.reject"]).records
    assert len(entries) == 1
    event = entries[0].event
    assert event.scope_tag == deriver.tenant_tag("acme")
    assert event.details == {"blocks_requested": 2, "blocks_in_flight": 3, "blocks_quota": 4}


@pytest.mark.anyio
async def test_a_request_that_can_never_fit_is_400_and_a_failed_one_frees_its_blocks(app) -> None:
    keys, held, client, _, _ = app
    held.release.set()
    never = await _post(client, keys["acme"], {"prompt": [7] * 100, "max_tokens": 40})  # 5 > 4
    assert never.status_code == 400 and "can never run" in never.json()["error"]["message"]
    with pytest.raises(RuntimeError):
        await _post(client, keys["acme"], {"prompt": [7] * 60, "max_tokens": 60, "fail": True})
    ok = await _post(client, keys["acme"], {"prompt": [7] * 60, "max_tokens": 60})  # 4 blocks
    assert ok.status_code == 200  # the failed request's blocks were released


@pytest.mark.anyio
async def test_a_route_counts_the_prompt_it_runs_and_never_a_decoy_field() -> None:
    """What a route reads is what counts: `prompt` on /v1/completions even with a `messages` field
    beside it (reviewer's finding: a one-line decoy made a 900-token request count one block),
    `messages` on chat, the larger of both on /invocations, `input` on /v1/responses. Without
    vLLM's tokenizer (no app state here) every string counts its characters, an upper bound."""
    long_prompt = "x" * 900
    decoy = {"prompt": long_prompt, "messages": [{"role": "user", "content": "hi"}]}
    assert (await prompt_tokens({"path": "/v1/completions"}, decoy))[0] == (900,)
    assert (await prompt_tokens({"path": "/v1/chat/completions"}, decoy))[0] == (len("userhi"),)
    assert (await prompt_tokens({"path": "/invocations"}, decoy))[0] == (900,)
    assert (await prompt_tokens({"path": "/v1/completions"}, {"prompt": [1, 2, 3]}))[0] == (3,)
    responses = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "abc"}]}]}
    expected = len("user") + len("input_text") + len("abc")
    assert (await prompt_tokens({"path": "/v1/responses"}, responses))[0] == (expected,)
    # Every other field a template can render counts its JSON text there too (only `input`,
    # `instructions` and `tools` counted: a `text.format` schema ran uncounted); options nothing.
    schema = {"format": {"type": "json_schema", "schema": {"description": "d" * 500}}}
    extra = {"text": schema, "instructions": "be brief", "max_output_tokens": 8, "stream": True}
    counted = (await prompt_tokens({"path": "/v1/responses"}, {**responses, **extra}))[0]
    assert counted == (expected + len(json.dumps(schema)) + len(json.dumps("be brief")),)


async def _post_to(client, key, path, body):
    return await client.post(path, json=body, headers={"authorization": f"Bearer {key}"})


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/completions", "/invocations"])
async def test_a_batched_prompt_counts_every_item_as_its_own_request(app, path) -> None:
    """vLLM runs each item of `prompt: [...]` as its own request, with its own `max_tokens` x `n`
    outputs (reviewer's finding: 50 one-token prompts with max_tokens 31 counted as one sequence,
    3 blocks, where the engine needs 50, so a 4-block reject quota admitted them)."""
    keys, held, client, _, _ = app
    held.release.set()
    batch = {"model": "tiny", "prompt": [[i + 1] for i in range(50)], "max_tokens": 31}
    never = await _post_to(client, keys["acme"], path, batch)
    assert never.status_code == 400 and "needs 50 KV blocks" in never.json()["error"]["message"]
    texts = {"model": "tiny", "prompt": ["x" * 20] * 3, "max_tokens": 20}  # 3 x 40 tokens: 6
    assert (await _post_to(client, keys["acme"], path, texts)).status_code == 400
    fits = {"model": "tiny", "prompt": [[7] * 20] * 2, "max_tokens": 20}  # 2 x 40 tokens: 4
    assert (await _post_to(client, keys["acme"], path, fits)).status_code == 200
    # the refused batches never reached the engine
    assert [r["prompt"] for r in held.reached] == [fits["prompt"]]


@pytest.mark.anyio
async def test_a_batched_prompt_counts_each_item_its_own_output_and_sequences() -> None:
    scope = {"path": "/v1/completions"}
    body = {"prompt": [[1], [1, 2, 3], "abcd"], "max_tokens": 31, "n": 2}
    prompts, _ = await prompt_tokens(scope, body)
    assert prompts == (1, 3, 4)
    # (1 + 31) -> 1, (3 + 31) -> 2, (4 + 31) -> 2 blocks of 32; times n
    assert blocks_needed(body, prompts, 0, 32, "/v1/completions") == 10
    # without max_tokens vLLM fills each request up to the model length: 2 blocks each
    assert blocks_needed({"prompt": []}, prompts, 64, 32, "/v1/completions") == 6
    assert blocks_needed({"max_tokens": 31}, 1, 0, 32, "/v1/completions") == 1  # one prompt


@pytest.mark.anyio
@pytest.mark.parametrize(
    "extra",
    [
        {"documents": [{"title": "d", "text": "lorem ipsum " * 1000}]},
        {"response_format": {"type": "json_schema", "json_schema": {"d": "lorem " * 1000}}},
        {"chat_template_kwargs": {"documents": [{"text": "lorem ipsum " * 1000}]}},
        {"reasoning_effort": "lorem " * 1000},
        {"tool_choice": {"type": "function", "function": {"name": "lorem" * 1000}}},
    ],
    ids=["documents", "response_format", "chat_template_kwargs", "scalar", "tool_choice"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
async def test_chat_fields_a_template_renders_count_toward_a_reject_quota(app, path, extra) -> None:
    """Renderers put more of a chat body into the prompt than `messages` (vLLM's
    `build_chat_params`: documents, reasoning_effort, response_format, tool_choice; reviewer's
    finding: a 1,000-word document beside a one-word message ran under a 4-block reject quota
    while the same text as a message was refused). Every field that is not a scalar sampling
    option counts the characters of its JSON text."""
    keys, held, client, _, _ = app
    held.release.set()
    short = [{"role": "user", "content": "summarise"}]
    body = {"model": "tiny", "max_tokens": 8, "messages": short, **extra}
    response = await _post_to(client, keys["acme"], path, body)
    assert response.status_code == 400 and "can never run" in response.text
    plain = {"model": "tiny", "max_tokens": 8, "temperature": 0.5, "stream": False}
    ok = await _post_to(client, keys["acme"], path, {**plain, "messages": short})
    assert ok.status_code == 200  # sampling options count nothing
    assert len(held.reached) == 1  # the refused request never reached the engine


@pytest.mark.anyio
async def test_chat_fields_count_their_json_text_and_sampling_options_nothing() -> None:
    scope = {"path": "/v1/chat/completions"}
    messages = [{"role": "user", "content": "hi"}]
    options = {"model": "tiny", "max_tokens": 8, "n": 2, "temperature": 0.1, "stream": True}
    assert (await prompt_tokens(scope, {**options, "messages": messages}))[0] == (len("userhi"),)
    # What the OpenAI SDK sends beside them is never rendered either: nothing counted (a re-test
    # found `stop` and `stream_options` refusing ordinary requests under a small quota).
    sdk = {
        "stop": ["\n\nUser:", "</s>"],
        "stream_options": {"include_usage": True},
        "logit_bias": {str(t): 1 for t in range(100)},
        "stop_token_ids": [1, 2, 3],
    }
    assert (await prompt_tokens(scope, {**sdk, "messages": messages}))[0] == (len("userhi"),)
    rendered = {"documents": [{"text": "ab", "n": [1, None, 2.5]}], "response_format": {}}
    expected = len("userhi") + sum(len(json.dumps(v)) for v in rendered.values())
    assert (await prompt_tokens(scope, {"messages": messages, **rendered}))[0] == (expected,)
    deep: object = "x"
    for _ in range(100_000):  # deeper than `json.dumps` recurses: counted, never a 500
        deep = [deep]
    counted = (await prompt_tokens(scope, {"messages": messages, "documents": deep}))[0]
    assert counted[0] > 100_000


@pytest.mark.anyio
async def test_media_settings_reach_the_tokenizer_that_counts_the_prompt() -> None:
    """`mm_processor_kwargs` and `media_io_kwargs` decide how many tokens media become (a video's
    frames, an image's size): the count was made at vLLM's defaults (found by a re-test)."""
    from types import SimpleNamespace  # noqa: PLC0415

    seen: list[Any] = []

    class Serving:
        async def create_tokenize(self, request: Any, raw: Any) -> Any:
            seen.append(request)
            return SimpleNamespace(count=5)

    app = SimpleNamespace(state=SimpleNamespace(serving_tokenization=Serving(), vllm_config=None))
    scope = {"path": "/v1/chat/completions", "app": app, "type": "http", "headers": []}
    media = {"mm_processor_kwargs": {"max_pixels": 10**6}, "media_io_kwargs": {"video": {"n": 8}}}
    doc = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **media}
    assert (await prompt_tokens(scope, doc))[0] == (5,)
    assert seen[-1].mm_processor_kwargs == media["mm_processor_kwargs"]
    assert seen[-1].media_io_kwargs == media["media_io_kwargs"]
