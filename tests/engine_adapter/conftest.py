from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvguard.engine_adapter.custody import Custody
from kvguard.isolation import (
    CacheConfig,
    Keyring,
    ModelRef,
    SaltDeriver,
    Scope,
    Share,
    TokenizerRef,
)
from kvguard.policy import PolicySet, TenantPolicy
from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets

DERIVER = SaltDeriver(Keyring({"k1": bytes(range(32))}, active="k1"))


def scope_for(
    tenant: str,
    *,
    session: str | None = None,
    group: str | None = None,
    model: str = "m",
    adapter: Any = None,
) -> Scope:
    share = Share.SESSION if session else Share.GROUP if group else Share.TENANT
    return Scope(
        tenant_id=tenant,
        share=share,
        session_id=session,
        group_id=group,
        model=ModelRef(id=model, revision="1"),
        tokenizer=TokenizerRef(id="t", revision="1"),
        adapter=adapter,
        cache_config=CacheConfig(kv_dtype="bf16", block_size=16),
    )


@pytest.fixture
def make_custody() -> Callable[..., Custody]:
    def make(
        num_blocks: int = 16,
        policies: dict[str, TenantPolicy] | None = None,
        default: TenantPolicy | None = None,
    ) -> Custody:
        pset = PolicySet(default=default or TenantPolicy(), tenants=policies or {})
        return Custody(num_blocks, policy=pset.policy_for, tagger=DERIVER.scope_tag)

    return make


@pytest.fixture(scope="session")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The one in-process governed engine of the test session (vLLM keeps process-global state, so a
    second in-process engine in the same process would share the first one's connector agent).

    Its control database is the ledger database; it follows the (initially empty) policy store in
    `policy.db`, so it starts on the policy file."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415

    workdir = tmp_path_factory.mktemp("engine")
    options = GuardOptions(
        **write_secrets(workdir), canary=True, policy_url=f"sqlite:///{workdir / 'policy.db'}"
    )
    g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
    yield g
    g.close()


# Fresh SQLite / PostgreSQL databases per test (the control-plane fixtures, shared here).
from tests.control.conftest import db_url, pg_url, sqlite_url  # noqa: E402, F401
