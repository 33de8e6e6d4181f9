"""RFC 6962 hashing and RFC 9162 proofs: every conformance vector (tests/conformance/), both directions, plus
properties over generated trees."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.audit import merkle
from kvguard.errors import VerificationError

from .conftest import conformance_dir


def _b64(value: str | None) -> bytes:
    return base64.b64decode(value or "")


def _cases(kind: str) -> list[Path]:
    root = conformance_dir(f"merkle/{kind}")
    return sorted(root.rglob("*.json"))


def _case_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _inclusion_files() -> list[Path]:
    return _cases("inclusion")


def _consistency_files() -> list[Path]:
    return _cases("consistency")


def test_vectors_are_present() -> None:
    conformance_dir("merkle")  # carried in tests/conformance/: a bare clone runs them too
    assert len(_inclusion_files()) > 50
    assert len(_consistency_files()) > 50


@pytest.mark.parametrize("path", _inclusion_files(), ids=_case_id)
def test_inclusion_vector(path: Path) -> None:
    case = json.loads(path.read_text())
    proof = [_b64(p) for p in case["proof"] or []]
    args = (case["leafIdx"], case["treeSize"], _b64(case["leafHash"]), proof, _b64(case["root"]))
    if case["wantErr"]:
        with pytest.raises(VerificationError):
            merkle.verify_inclusion(*args)
    else:
        merkle.verify_inclusion(*args)


@pytest.mark.parametrize("path", _consistency_files(), ids=_case_id)
def test_consistency_vector(path: Path) -> None:
    case = json.loads(path.read_text())
    proof = [_b64(p) for p in case["proof"] or []]
    args = (case["size1"], case["size2"], _b64(case["root1"]), _b64(case["root2"]), proof)
    if case["wantErr"]:
        with pytest.raises(VerificationError):
            merkle.verify_consistency(*args)
    else:
        merkle.verify_consistency(*args)


def _naive_root(leaves: Sequence[bytes]) -> bytes:
    """MTH straight from RFC 6962 section 2.1's recursive definition."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return hashlib.sha256(b"\x00" + leaves[0]).digest()
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return hashlib.sha256(b"\x01" + _naive_root(leaves[:k]) + _naive_root(leaves[k:])).digest()


def _reader(leaves: Sequence[bytes]) -> merkle.HashReader:
    def read(subtrees: Sequence[merkle.Subtree]) -> list[bytes]:
        out = []
        for s in subtrees:
            lo = s.position << s.level
            out.append(_naive_root(leaves[lo : lo + (1 << s.level)]))
        return out

    return read


def _leaves(n: int) -> list[bytes]:
    return [f"leaf-{i}".encode() for i in range(n)]


def test_empty_tree_root_is_sha256_of_nothing() -> None:
    assert merkle.EMPTY_ROOT.hex().startswith("e3b0c442")
    assert merkle.root_from_subtrees(0, _reader([])) == merkle.EMPTY_ROOT


@given(st.integers(min_value=1, max_value=70), st.data())
def test_generated_inclusion_proofs_verify(n: int, data: st.DataObject) -> None:
    leaves = _leaves(n)
    index = data.draw(st.integers(min_value=0, max_value=n - 1))
    root = merkle.root_from_subtrees(n, _reader(leaves))
    assert root == _naive_root(leaves)
    proof = merkle.hashes_for_ranges(merkle.inclusion_ranges(index, n), _reader(leaves))
    merkle.verify_inclusion(index, n, merkle.leaf_hash(leaves[index]), proof, root)
    levels = merkle.tree_levels(merkle.leaf_hash(leaf) for leaf in leaves)
    assert merkle.levels_root(levels) == root
    assert merkle.levels_inclusion_proof(levels, index) == proof
    with pytest.raises(VerificationError):
        merkle.verify_inclusion(index, n, merkle.leaf_hash(b"other"), proof, root)


@given(st.integers(min_value=1, max_value=70), st.data())
def test_generated_consistency_proofs_verify(n: int, data: st.DataObject) -> None:
    leaves = _leaves(n)
    m = data.draw(st.integers(min_value=1, max_value=n))
    read = _reader(leaves)
    proof = merkle.hashes_for_ranges(merkle.consistency_ranges(m, n), read)
    old_root, new_root = _naive_root(leaves[:m]), _naive_root(leaves)
    merkle.verify_consistency(m, n, old_root, new_root, proof)
    if m < n:
        forked = _naive_root([*leaves[: m - 1], b"forked"])
        with pytest.raises(VerificationError):
            merkle.verify_consistency(m, n, forked, new_root, proof)


def test_proof_size_is_logarithmic() -> None:
    n = 1_000_003
    assert len(merkle.inclusion_ranges(123_456, n)) <= 21
    wanted = {
        s for lo, hi in merkle.inclusion_ranges(n - 1, n) for s in merkle.range_subtrees(lo, hi)
    }
    assert len(wanted) <= 2 * 21
    wanted = {
        s for lo, hi in merkle.consistency_ranges(777_777, n) for s in merkle.range_subtrees(lo, hi)
    }
    assert len(wanted) <= 2 * 21
