from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.errors import IsolationError
from kvguard.isolation import chain_block_hash, chain_hashes

tokens = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40)


@given(tokens, st.text(min_size=1), st.text(min_size=1))
def test_G1_salt_scopes_every_descendant(toks: list[int], s1: str, s2: str) -> None:
    a = chain_hashes(toks * 3, len(toks), s1)
    b = chain_hashes(toks * 3, len(toks), s2)
    assert len(a) == 3
    assert all((x == y) == (s1 == s2) for x, y in zip(a, b, strict=True))


@given(tokens, tokens)
def test_different_tokens_different_hash(t1: list[int], t2: list[int]) -> None:
    assert (chain_block_hash(None, t1, "s") == chain_block_hash(None, t2, "s")) == (t1 == t2)


def test_parent_matters_and_root_differs_from_child() -> None:
    root = chain_block_hash(None, [1, 2], "salt")
    other = chain_block_hash(None, [1, 3], "salt")
    assert chain_block_hash(root, [5], "salt") != chain_block_hash(other, [5], "salt")
    assert chain_block_hash(root, [1, 2], "") != root


def test_partial_trailing_block_not_hashed() -> None:
    assert len(chain_hashes(list(range(35)), 16, "s")) == 2


def test_bad_input_refused_without_echoing_tokens() -> None:
    with pytest.raises(IsolationError, match="non-empty salt"):
        chain_block_hash(None, [1], "")
    with pytest.raises(IsolationError) as info:
        chain_block_hash(None, [1234567, -5], "s")
    assert "1234567" not in str(info.value)
    with pytest.raises(IsolationError, match="32 bytes"):
        chain_block_hash(b"short", [1], "s")  # type: ignore[arg-type]
    with pytest.raises(IsolationError, match="block_size"):
        chain_hashes([1], 0, "s")
