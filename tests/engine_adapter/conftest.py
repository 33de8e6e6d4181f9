from __future__ import annotations

from collections.abc import Callable
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


# Fresh SQLite / PostgreSQL databases per test (the control-plane fixtures, shared here).
from tests.api.conftest import make_env, pg_db  # noqa: E402, F401 (the admin API beside engines)
from tests.control.conftest import db_url, pg_url, sqlite_url  # noqa: E402, F401


@pytest.fixture(scope="session")
def served_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `kvguard engine serve` for every module that drives the real server with its default
    options (starting vLLM on the CPU takes most of a minute); modules that need other options or
    kill the server start their own. Tests keep to their own tenants, so they do not see each other."""
    from tests.engine_adapter import served  # noqa: PLC0415 (imports vLLM's test helpers)

    server = served.start(tmp_path_factory.mktemp("served"))
    yield server
    served.stop(server)
