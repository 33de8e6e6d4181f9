from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.isolation import CacheConfig, ModelRef, Scope, Share, TokenizerRef
from kvguard.policy import PolicySet, prefix_digest

FIXTURES = Path(__file__).parent / "fixtures"
EXAMPLES = Path(__file__).parents[2] / "examples" / "policies"
PREFIX_DIGEST = prefix_digest(range(1, 513))


def scope(tenant: str = "acme", share: Share = Share.TENANT, **overrides: Any) -> Scope:
    """A valid scope; `session_id`/`group_id` are filled in to match `share` unless given."""
    data: dict[str, Any] = {
        "tenant_id": tenant,
        "share": share,
        "model": ModelRef(id="meta-llama/Llama-3-8B", revision="r1"),
        "tokenizer": TokenizerRef(id="meta-llama/Llama-3-8B", revision="r1"),
        "cache_config": CacheConfig(kv_dtype="bf16", block_size=16),
        "policy_epoch": 0,
    }
    if share is Share.SESSION:
        data["session_id"] = "s1"
    if share is Share.GROUP:
        data["group_id"] = "g"
    data.update(overrides)
    return Scope(**data)


def policy_set(tenants: dict[str, dict[str, Any]] | None = None, **top: Any) -> PolicySet:
    """A PolicySet with one share group `g`; tenants given as plain dicts, as in a document."""
    data: dict[str, Any] = {
        "share_groups": {"g": {"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}]}},
        "tenants": tenants or {},
    }
    data.update(top)
    return PolicySet.model_validate(data)


@pytest.fixture
def make_scope() -> Callable[..., Scope]:
    return scope


@pytest.fixture
def make_policy_set() -> Callable[..., PolicySet]:
    return policy_set
