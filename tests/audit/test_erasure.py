"""Linking a purge's quarantined blocks to the clears that cover them (`kvguard.audit.erasure`)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.audit import erasure
from kvguard.errors import VerificationError


def _purge(index: int, blocks: tuple[int, ...], engine: str | None = "e1") -> erasure.PurgeEntry:
    return erasure.PurgeEntry(index, "tenant.purge", "t", 7, engine, blocks, 0)


def _clear(
    index: int, blocks: set[int], engine: str | None = "e1", handover: bool = False
) -> erasure.ZeroizeEntry:
    return erasure.ZeroizeEntry(
        index,
        "t",
        engine,
        frozenset(blocks),
        handover,
        "torch",
        "cpu",
        "full",
        True,
        10 * len(blocks),
    )


def test_only_a_later_release_clear_of_the_same_engine_covers() -> None:
    purge = _purge(10, (1, 2, 3))
    clears = [
        _clear(5, {1, 2, 3}),  # before the purge
        _clear(11, {1}, handover=True),  # about the block's next owner
        _clear(12, {2}, engine="e2"),  # another engine's block 2
        _clear(13, {2, 3, 9}),
        _clear(14, {1, 2}),
    ]
    coverage = erasure.cover([purge], clears)
    assert coverage.links == {(10, 2): 13, (10, 3): 13, (10, 1): 14}
    assert coverage.complete and coverage.zeroize_indices() == [13, 14]
    missing = erasure.cover([purge], clears[:4])
    assert missing.missing == {10: frozenset({1})}


def test_without_engine_ids_every_engine_is_one_id_space() -> None:
    coverage = erasure.cover([_purge(1, (4,), engine=None)], [_clear(2, {4}, engine="e9")])
    assert coverage.links == {(1, 4): 2}
    coverage = erasure.cover([_purge(1, (4,))], [_clear(2, {4}, engine=None)])
    assert coverage.links == {(1, 4): 2}


entries = st.lists(
    st.tuples(
        st.sampled_from(["e1", "e2", None]),
        st.sets(st.integers(0, 5), min_size=1, max_size=4),
        st.booleans(),
    ),
    max_size=12,
)


@given(entries, st.integers(0, 12), st.sampled_from(["e1", "e2", None]))
def test_each_link_is_the_first_qualifying_clear(
    raw: list[tuple[str | None, set[int], bool]], at: int, engine: str | None
) -> None:
    purge = _purge(at, (0, 1, 2, 3), engine)
    clears = [_clear(i, b, e, h) for i, (e, b, h) in enumerate(raw) if i != at]
    coverage = erasure.cover([purge], clears)
    for block in purge.block_ids:
        qualifying = [
            z.index
            for z in clears
            if z.index > at
            and not z.handover
            and block in z.block_ids
            and erasure.same_engine(engine, z.engine_id)
        ]
        assert coverage.links.get((at, block)) == (min(qualifying) if qualifying else None)
        assert (block in coverage.missing.get(at, frozenset())) == (not qualifying)


def test_summary_refuses_incomplete_coverage_and_failed_or_inconsistent_clears() -> None:
    purge = _purge(1, (1,))
    with pytest.raises(VerificationError, match="not every quarantined block"):
        erasure.summary([purge], [], erasure.cover([purge], []))
    for verified, mode in ((False, "full"), (None, "sample"), (True, "none")):
        bad = _clear(2, {1})
        bad = erasure.ZeroizeEntry(**{**_fields(bad), "verified": verified, "verify_mode": mode})
        with pytest.raises(VerificationError, match="verification result"):
            erasure.summary([purge], [bad], erasure.cover([purge], [bad]))


def _fields(z: erasure.ZeroizeEntry) -> dict[str, object]:
    return {name: getattr(z, name) for name in erasure.ZeroizeEntry.__slots__}


def test_leaves_must_be_canonical_and_complete() -> None:
    obj = {"block_ids": [1], "details": {}, "kind": "block.zeroize", "ts": "t", "v": 1}
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    assert erasure.parse_leaf(canonical) == obj
    for bad in (
        json.dumps(obj).encode(),  # spaces
        canonical.replace(b'"v":1', b'"v":1,"v":1'),  # a duplicate key
        canonical.replace(b'"v":1', b'"v":2'),
        b"\xff",
    ):
        with pytest.raises(VerificationError):
            erasure.parse_leaf(bad)
    with pytest.raises(VerificationError, match="handover"):
        erasure.zeroize_entry(3, obj)
    purge = {**obj, "kind": "tenant.purge", "block_ids": [1, 2]}
    purge["details"] = {"command_id": 7, "blocks_quarantined": 1, "blocks_active_doomed": 0}
    with pytest.raises(VerificationError, match="blocks_quarantined"):
        erasure.purge_entry(3, purge)
