"""Linking a purge's quarantined blocks to the clears that cover them (`kvguard.audit.erasure`)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.audit import erasure
from kvguard.audit.leaf import command_links
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
        assert not erasure.passed(bad)
        with pytest.raises(VerificationError, match="verification result"):
            erasure.check_clear(bad)
        # It covers nothing (rule 4): the block waits for a clear that passed, after it or not.
        good = _clear(3, {1})
        assert erasure.cover([purge], [bad]).missing == {1: frozenset({1})}
        assert erasure.cover([purge], [bad, good]).links == {(1, 1): 3}
        with pytest.raises(VerificationError, match="not every quarantined block"):
            erasure.summary([purge], [bad], erasure.cover([purge], [bad]))


def test_engines_without_an_id_count_once_per_purge_not_per_part() -> None:
    """The parts of a split purge entry share the engine and the time: one engine, whether or not
    the entries name it; two anonymous purges at different times are two engines."""
    parts = [
        erasure.PurgeEntry(1, "tenant.purge", "t1", 7, None, (1,), 0),
        erasure.PurgeEntry(2, "tenant.purge", "t1", 7, None, (2,), 0),
    ]
    other = erasure.PurgeEntry(3, "tenant.purge", "t2", 7, None, (1,), 0)
    assert erasure.engines_in(parts) == 1
    assert erasure.engines_in([*parts, other]) == 2
    assert erasure.engines_in([*parts, _purge(4, (5,))]) == 2
    facts = erasure.engine_facts(parts, [], erasure.cover(parts, []))
    assert facts[None]["engines"] == 1 and facts[None]["purge_entries"] == 2


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


# --- offloaded copies: key.shred entries (issue 15) -------------------------------------------------


def _tier_purge(
    index: int, keys: int, engine: str | None = "e1", command: int = 7
) -> erasure.PurgeEntry:
    return erasure.PurgeEntry(
        index, "tenant.purge", "t", command, engine, (), 0, keys, 3 * keys, 300 * keys
    )


def _shred(
    index: int,
    engine: str | None = "e1",
    command: int | None = 7,
    entries: int = 3,
    reason: str = "purge",
) -> erasure.ShredEntry:
    return erasure.ShredEntry(
        index, f"ts{index:03d}", engine, command, reason, 1, entries, 100 * entries
    )


def test_a_purge_with_offload_keys_is_covered_by_as_many_later_shreds() -> None:
    purge = _tier_purge(10, keys=2)
    shreds = [_shred(11), _shred(12, entries=1)]
    offload = erasure.cover_offload([purge], shreds)
    assert offload.complete and offload.links == {10: (11, 12)}
    assert offload.shred_indices() == [11, 12]
    assert erasure.offload_summary([purge], shreds, offload) == {
        "keys_destroyed": 2,
        "entries_deleted": 4,
        "bytes_deleted": 400,
        "key_shred_entries": [11, 12],
        "shredded_first": "ts011",
        "shredded_last": "ts012",
    }


def test_a_missing_shred_leaves_the_purge_uncovered_and_refuses_a_summary() -> None:
    purge = _tier_purge(10, keys=2)
    offload = erasure.cover_offload([purge], [_shred(11)])
    assert not offload.complete and offload.missing == {10: 1}
    with pytest.raises(VerificationError, match=r"key\.shred"):
        erasure.offload_summary([purge], [_shred(11)], offload)


@pytest.mark.parametrize(
    "shred",
    [
        _shred(5),  # before the purge entry (an earlier purge's, or an expiry's)
        _shred(10),  # the purge entry's own index: not after it
        _shred(11, engine="e2"),  # another engine's key
        _shred(12, command=8),  # another job's
        _shred(13, command=None, reason="expiry"),  # not caused by a purge
        _shred(14, reason="shutdown"),  # a job's id, but not a purge's shred
    ],
)
def test_shreds_that_do_not_count(shred: erasure.ShredEntry) -> None:
    purge = _tier_purge(10, keys=1)
    offload = erasure.cover_offload([purge], [shred])
    assert offload.missing == {10: 1} and offload.shred_indices() == []
    assert not erasure.counts_for(purge, shred)


def test_engines_without_ids_are_one_id_space_for_shreds_too() -> None:
    assert erasure.cover_offload([_tier_purge(1, 1, engine=None)], [_shred(2)]).complete
    assert erasure.cover_offload([_tier_purge(1, 1)], [_shred(2, engine=None)]).complete


def test_purges_without_a_tier_need_no_shred_and_have_no_offload_part() -> None:
    purges = [_tier_purge(1, keys=0), _purge(2, ())]
    offload = erasure.cover_offload(purges, [_shred(3)])
    assert offload == erasure.NO_OFFLOAD and offload.complete
    assert erasure.offload_summary(purges, [], offload) is None
    assert erasure.offload_engine_facts([_shred(3)], offload) == {}


def test_offload_sums_per_engine_and_in_total_count_each_shred_once() -> None:
    # engine e1's purge entry split in two parts, each repeating its tier figures: the same two
    # shreds cover both, and each counts once; e2 destroyed one key
    purges = [_tier_purge(1, 2), _tier_purge(2, 2), _tier_purge(3, 1, engine="e2")]
    shreds = [_shred(4, entries=2), _shred(5, entries=5), _shred(6, engine="e2", entries=1)]
    offload = erasure.cover_offload(purges, shreds)
    assert offload.links == {1: (4, 5), 2: (4, 5), 3: (6,)} and offload.complete
    assert erasure.offload_engine_facts(shreds, offload) == {
        "e1": {
            "keys_destroyed": 2,
            "entries_deleted": 7,
            "bytes_deleted": 700,
            "key_shred_entries": [4, 5],
        },
        "e2": {
            "keys_destroyed": 1,
            "entries_deleted": 1,
            "bytes_deleted": 100,
            "key_shred_entries": [6],
        },
    }
    total = erasure.offload_summary(purges, shreds, offload)
    assert total is not None
    assert (total["keys_destroyed"], total["entries_deleted"], total["bytes_deleted"]) == (
        3,
        8,
        800,
    )
    assert total["key_shred_entries"] == [4, 5, 6]


def _leaf(
    kind: str, details: dict[str, object], blocks: list[int] | None = None
) -> dict[str, object]:
    return {"block_ids": blocks or [], "details": details, "kind": kind, "ts": "t", "v": 1}


def test_shred_and_tier_purge_leaves_parse_strictly() -> None:
    details: dict[str, object] = {
        "engine_id": "e1",
        "command_id": 7,
        "reason": "purge",
        "destroyed_epoch": 3,
        "entry_count": 4,
        "bytes_deleted": 4096,
    }
    shred = erasure.shred_entry(9, _leaf("key.shred", details))
    assert shred == erasure.ShredEntry(9, "t", "e1", 7, "purge", 3, 4, 4096)
    expiry = {k: v for k, v in details.items() if k not in ("command_id", "destroyed_epoch")}
    assert erasure.shred_entry(9, _leaf("key.shred", expiry)).command_id is None
    for name, bad in (
        ("entry_count", -1),
        ("bytes_deleted", None),
        ("command_id", True),
        ("destroyed_epoch", "3"),
        ("reason", ""),
        ("engine_id", 5),
    ):
        with pytest.raises(VerificationError, match=name):
            erasure.shred_entry(9, _leaf("key.shred", {**details, name: bad}))
    with pytest.raises(VerificationError, match=r"not a key\.shred"):
        erasure.shred_entry(9, _leaf("block.zeroize", details))
    base: dict[str, object] = {"command_id": 7, "blocks_quarantined": 1, "blocks_active_doomed": 0}
    assert erasure.purge_entry(3, _leaf("tenant.purge", base, [1])).tier_key_count == 0
    tiered = {**base, "tier_key_count": 2, "tier_entry_count": 5, "tier_bytes": 640}
    p = erasure.purge_entry(3, _leaf("tenant.purge", tiered, [1]))
    assert (p.tier_key_count, p.tier_entry_count, p.tier_bytes) == (2, 5, 640)
    with pytest.raises(VerificationError, match="tier_key_count"):
        erasure.purge_entry(3, _leaf("tenant.purge", {**tiered, "tier_key_count": -2}, [1]))


@pytest.mark.parametrize(
    ("details", "links"),
    [
        ({"command_id": 7, "reason": "purge"}, (7,)),
        ({"reason": "expiry"}, ()),
        ({"command_id": "7", "reason": "purge"}, ()),
    ],
)
def test_key_shreds_of_a_purge_link_to_its_job(
    details: dict[str, object], links: tuple[int, ...]
) -> None:
    assert command_links("key.shred", details) == links
    assert command_links("tier.auth_failure", details) == ()
