"""Found by an independent review of tenant inference keys and the dashboard (each failed before its fix).

1. A disabled tenant's inference key is still accepted by the serving front end on its read routes
   (`GET /v1/models`, `POST /tokenize`, `POST /detokenize`), although docs/vllm.md says "a tenant
   refused by policy (disabled) gets 403" and docs/api.md that after a disable "engines and the
   `vllm serve` middleware then refuse its requests".
2. `kvguard keys tenant-key create|revoke|list` given an argument the database cannot hold (a
   non-UTF-8 byte, which Python passes on as a lone surrogate) dies with a traceback, exit 1 and no
   JSON, where docs/cli.md promises exit 2 for "a value the database refuses" and, with `--json`, one
   JSON object with `error` and `exit_code` on any non-zero exit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest
from typer.testing import CliRunner

from kvguard.cli import app as cli_app
from kvguard.engine_adapter.vllm.serve import KVGuardMiddleware
from kvguard.isolation import CacheConfig, Keyring, ModelRef, SaltDeriver
from kvguard.policy.store import PolicyStore
from tests.api.conftest import ApiEnv


async def _engine(scope, receive, send) -> None:  # stands in for vLLM's app
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"reached the engine"})


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"model": "tiny", "prompt": "hello"}),
        ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2]}),
    ],
)
def test_disabled_tenants_key_is_refused_on_read_routes(
    make_env: Callable[..., ApiEnv], method: str, path: str, body: dict | None
) -> None:
    env = make_env()
    issued = env.call("admin", "POST", "/v1/tenants/acme/inference-keys")
    assert issued.status_code == 201
    api_key = issued.json()["api_key"]
    disabled = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "ended"})
    assert disabled.status_code == 200

    front = KVGuardMiddleware(
        _engine,
        keys=env.services.inference_keys,
        deriver=SaltDeriver(Keyring.generate("k1")),
        policy_store=PolicyStore.open(env.services.config.db_url),
        model=ModelRef(id="tiny", revision="1"),
        cache=CacheConfig(kv_dtype="auto", block_size=32),
    )

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            # The governed route is refused (403): the policy version of the disable is in force.
            governed = await client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1},
                headers={"authorization": f"Bearer {api_key}"},
            )
            assert governed.status_code == 403
            return await client.request(
                method, path, json=body, headers={"authorization": f"Bearer {api_key}"}
            )

    answer = asyncio.run(call())
    assert answer.status_code == 403, (answer.status_code, answer.text)
    assert b"reached the engine" not in answer.content


@pytest.mark.parametrize(
    "args",
    [
        ["create", "\udcff"],
        ["revoke", "\udcff"],
        ["list", "--tenant", "\udcff"],
    ],
)
def test_tenant_key_cli_refuses_unstorable_argument_cleanly(
    make_env: Callable[..., ApiEnv], args: list[str]
) -> None:
    env = make_env()
    url = env.services.config.db_url
    result = CliRunner().invoke(cli_app, ["keys", "tenant-key", *args, "--db", url, "--json"])
    assert result.exit_code == 2, (result.exit_code, repr(result.exception))
    answer = json.loads(result.stdout)
    assert answer["exit_code"] == 2
    assert answer["error"]
