from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import strategies as st

from kvguard.isolation import AdapterRef, CacheConfig, ModelRef, Scope, Share, TokenizerRef

# Values chosen to break naive encodings: separators, NUL, unicode (pydantic refuses lone surrogates).
tricky_text = st.one_of(
    st.sampled_from(["a", "a|b", "a\x00b", "a:b", "\x00", "|", "é", "e\u0301", "x" * 40]),
    st.text(min_size=1, max_size=12),
)


@st.composite
def scopes(draw: st.DrawFn) -> Scope:
    share = draw(st.sampled_from(list(Share)))
    return Scope(
        tenant_id=draw(tricky_text),
        share=share,
        session_id=draw(tricky_text) if share is Share.SESSION else None,
        group_id=draw(tricky_text) if share is Share.GROUP else None,
        model=ModelRef(
            id=draw(tricky_text),
            revision=draw(tricky_text),
            weights_digest=draw(st.none() | st.just("") | tricky_text),
        ),
        tokenizer=TokenizerRef(id=draw(tricky_text), revision=draw(tricky_text)),
        adapter=draw(st.none() | st.builds(AdapterRef, id=tricky_text, revision=tricky_text)),
        cache_config=CacheConfig(
            kv_dtype=draw(tricky_text),
            block_size=draw(st.integers(1, 1 << 20)),
            quantization=draw(st.none() | st.just("") | tricky_text),
        ),
        policy_epoch=draw(st.integers(0, (1 << 63) - 1)),
    )


@pytest.fixture
def make_scope() -> Callable[..., Scope]:
    """Factory for a valid tenant-shared scope; keyword overrides replace top-level fields."""

    def make(**overrides: Any) -> Scope:
        data: dict[str, Any] = {
            "tenant_id": "acme",
            "share": Share.TENANT,
            "model": ModelRef(id="meta-llama/Llama-3-8B", revision="r1"),
            "tokenizer": TokenizerRef(id="meta-llama/Llama-3-8B", revision="r1"),
            "cache_config": CacheConfig(kv_dtype="bf16", block_size=16),
            "policy_epoch": 0,
        }
        data.update(overrides)
        return Scope(**data)

    return make
