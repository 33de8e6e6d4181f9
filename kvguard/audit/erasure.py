"""Erasure evidence: which ledger entries prove that a purge job's KV blocks were cleared.

Pure and standard library only. The admin API (which issues erasure certificates) and the offline
certificate verifier (`kvguard.audit.certificate`) link entries with this one module, so what the
API certifies is exactly what the verifier derives again from the leaves.

How a purge job shows up in the ledger. Every engine that executed job N records one
`<kind>.purge` entry (`session`, `tenant`, `model`, `adapter`) whose details carry
`command_id: N`, `blocks_quarantined`, `blocks_active_doomed` and, from engines that have it,
`engine_id`; its `block_ids` are the blocks it quarantined. The worker then clears them and the
engine records `block.zeroize` entries (the evidence of `kvguard.zeroize.evidence`, plus `handover`
and `engine_id`). A quarantined block is *covered* by the first `block.zeroize` entry after its
purge entry that

1. is a release clear (`handover: false`): a handover clear is about the block's next owner;
2. comes from the same engine: block ids are per engine, so two engines' entries may name the same
   id. Where either entry has no `engine_id` (engines that predate it), all engines' entries are
   treated as one id space;
3. lists the block;
4. passed its verification, or ran without one (`check_clear`): a clear whose read-back failed, or
   whose result disagrees with its mode, covers nothing, so the block waits for a clear that passed
   (a failed clear linked first made a job `done` whose certificate could never be issued).

Blocks that were in use when the purge ran (`blocks_active_doomed`) are quarantined when their
request ends and cleared like any released block; their ids are not in the purge entry, so they are
counted here, not linked.

How many engines the purge entries stand for (`engines_in`). An engine runs a job once; a purge of
more block ids than one entry holds is split into parts (`part` k of `parts`) that share the
engine and the time (`ledger_bridge.to_audit_events`). So entries without an `engine_id` count one
engine per distinct time, not one per entry: counted per entry, one engine's two parts stood for a
second engine whose purge entry was missing, and a single engine's split entry looked like two.

Offloaded copies (issue 15, docs/offload.md). An engine with an offload tier keeps evicted blocks
encrypted under one data key per reuse domain; a purge crypto-shreds the domains it selects. Its
purge entry then also carries `tier_key_count` (keys this purge must destroy on the engine),
`tier_entry_count` and `tier_bytes` (ciphertexts the tier held for those domains); engines without
a tier leave them out (0). For each key the engine later records one `key.shred` entry (details
`engine_id`, `command_id` of the job, `reason: "purge"`, `destroyed_epoch`, `entry_count`,
`bytes_deleted`). A purge entry with `tier_key_count = k > 0` is *covered for its offloaded copies*
when at least k `key.shred` entries with reason `purge` come after it, name its `command_id` and
come from the same engine (rule 2 above). Every such entry counts: the offload figures
(`keys_destroyed`, `entries_deleted`, `bytes_deleted`) are those of the `key.shred` entries
themselves, so a purge entry split into parts (each repeating the tier figures) counts no key twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from kvguard.errors import VerificationError

LEAF_VERSION: Final = 1
PURGE_KINDS: Final = ("session.purge", "tenant.purge", "model.purge", "adapter.purge")
ZEROIZE_KIND: Final = "block.zeroize"
SHRED_KIND: Final = "key.shred"
SHRED_PURGE_REASON: Final = "purge"
VERIFY_MODES: Final = frozenset({"none", "sample", "full"})
CLOCK_SKEW_S: Final = timedelta(minutes=5)  # engines and the API keep time by NTP
# How much earlier than its request entry a job's purge and key shred entries may be dated: the
# API looks for them from the job's creation less CLOCK_SKEW_S, and for the request within
# CLOCK_SKEW_S of the creation (`erasure_query`), so this holds all that the API accepts. Older
# entries are another job's under the same number (job ids repeat once a control database is
# restored from a backup or recreated while the ledger goes on).
JOB_ENTRY_LEAD: Final = 2 * CLOCK_SKEW_S


@dataclass(frozen=True, slots=True)
class PurgeEntry:
    """One engine's record of executing a purge job."""

    index: int
    kind: str
    ts: str
    command_id: int
    engine_id: str | None
    block_ids: tuple[int, ...]
    blocks_active_doomed: int
    tier_key_count: int = 0  # offload data keys this purge must destroy (0: no tier)
    tier_entry_count: int = 0
    tier_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ZeroizeEntry:
    """One `block.zeroize` entry: blocks cleared together, how, and how it was checked."""

    index: int
    ts: str
    engine_id: str | None
    block_ids: frozenset[int]
    handover: bool
    method: str
    device: str
    verify_mode: str
    verified: bool | None
    bytes_cleared: int


@dataclass(frozen=True, slots=True)
class ShredEntry:
    """One `key.shred` entry: an offload data key destroyed and its domain's ciphertexts deleted."""

    index: int
    ts: str
    engine_id: str | None
    command_id: int | None  # the purge job that caused it (None: expiry, disable, shutdown, ...)
    reason: str
    destroyed_epoch: int | None
    entry_count: int
    bytes_deleted: int


@dataclass(frozen=True, slots=True)
class Coverage:
    """`links[(purge index, block)]` is the covering zeroize entry; `missing` what is not covered."""

    links: dict[tuple[int, int], int]
    missing: dict[int, frozenset[int]]

    @property
    def complete(self) -> bool:
        return not self.missing

    def zeroize_indices(self) -> list[int]:
        return sorted(set(self.links.values()))


@dataclass(frozen=True, slots=True)
class OffloadCoverage:
    """`links[purge index]` are the `key.shred` entries that count for a purge entry with offload
    keys; `missing[purge index]` how many of its keys have no such entry yet."""

    links: dict[int, tuple[int, ...]]
    missing: dict[int, int]

    @property
    def complete(self) -> bool:
        return not self.missing

    def shred_indices(self) -> list[int]:
        return sorted({i for found in self.links.values() for i in found})


NO_OFFLOAD: Final = OffloadCoverage({}, {})


# --- leaves -----------------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise VerificationError("leaf has a duplicate key")
    return out


def parse_leaf(leaf: bytes) -> dict[str, Any]:
    """The JSON object of a version-1 leaf; refuses anything but its one canonical spelling."""
    try:
        obj = json.loads(leaf.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError):
        raise VerificationError("leaf is not UTF-8 JSON") from None
    if not isinstance(obj, dict) or obj.get("v") != LEAF_VERSION:
        raise VerificationError("leaf is not a version-1 event")
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if canonical.encode("utf-8") != leaf:
        raise VerificationError("leaf bytes are not in canonical form")
    if not isinstance(obj.get("details"), dict) or not isinstance(obj.get("ts"), str):
        raise VerificationError("leaf has no details or timestamp")
    return obj


def instant(ts: str, where: str) -> datetime:
    """A leaf's `ts` (UTC, ISO 8601 with a zone) as an aware datetime."""
    try:
        value = datetime.fromisoformat(ts)
    except ValueError:
        raise VerificationError(f"{where}: ts is not an ISO 8601 instant") from None
    if value.tzinfo is None:
        raise VerificationError(f"{where}: ts has no time zone")
    return value


def _int(details: dict[str, Any], name: str, where: str) -> int:
    value = details.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise VerificationError(f"{where}: details.{name} is not a non-negative integer")
    return value


def _optional_int(details: dict[str, Any], name: str, where: str) -> int | None:
    return None if details.get(name) is None else _int(details, name, where)


def _engine(details: dict[str, Any], where: str) -> str | None:
    value = details.get("engine_id")
    if value is not None and (not isinstance(value, str) or not value):
        raise VerificationError(f"{where}: details.engine_id is not a non-empty string")
    return value


def _block_ids(obj: dict[str, Any], where: str) -> tuple[int, ...]:
    ids = obj.get("block_ids")
    if not isinstance(ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids
    ):
        raise VerificationError(f"{where}: block_ids is not a list of block ids")
    return tuple(ids)


def purge_entry(index: int, obj: dict[str, Any]) -> PurgeEntry:
    """A `<kind>.purge` leaf as a `PurgeEntry` (VerificationError if it is not one)."""
    where = f"entry {index}"
    if obj.get("kind") not in PURGE_KINDS:
        raise VerificationError(f"{where}: not a purge entry")
    details = obj["details"]
    ids = _block_ids(obj, where)
    if len(set(ids)) != len(ids) or _int(details, "blocks_quarantined", where) != len(ids):
        raise VerificationError(f"{where}: blocks_quarantined disagrees with its block ids")
    return PurgeEntry(
        index=index,
        kind=obj["kind"],
        ts=obj["ts"],
        command_id=_int(details, "command_id", where),
        engine_id=_engine(details, where),
        block_ids=ids,
        blocks_active_doomed=_int(details, "blocks_active_doomed", where),
        tier_key_count=_optional_int(details, "tier_key_count", where) or 0,
        tier_entry_count=_optional_int(details, "tier_entry_count", where) or 0,
        tier_bytes=_optional_int(details, "tier_bytes", where) or 0,
    )


def zeroize_entry(index: int, obj: dict[str, Any]) -> ZeroizeEntry:
    """A `block.zeroize` leaf as a `ZeroizeEntry` (VerificationError if it is not one)."""
    where = f"entry {index}"
    if obj.get("kind") != ZEROIZE_KIND:
        raise VerificationError(f"{where}: not a block.zeroize entry")
    details = obj["details"]
    ids = _block_ids(obj, where)
    handover, verified = details.get("handover"), details.get("verified")
    if not isinstance(handover, bool) or (verified is not None and not isinstance(verified, bool)):
        raise VerificationError(f"{where}: handover or verified is not a boolean")
    mode, method, device = (details.get(k) for k in ("verify_mode", "method", "device"))
    if mode not in VERIFY_MODES or not isinstance(method, str) or not isinstance(device, str):
        raise VerificationError(f"{where}: verify_mode, method or device is missing")
    if _int(details, "block_count", where) != len(ids):
        raise VerificationError(f"{where}: block_count disagrees with its block ids")
    return ZeroizeEntry(
        index=index,
        ts=obj["ts"],
        engine_id=_engine(details, where),
        block_ids=frozenset(ids),
        handover=handover,
        method=method,
        device=device,
        verify_mode=mode,
        verified=verified,
        bytes_cleared=_int(details, "bytes_cleared", where),
    )


def shred_entry(index: int, obj: dict[str, Any]) -> ShredEntry:
    """A `key.shred` leaf as a `ShredEntry` (VerificationError if it is not one)."""
    where = f"entry {index}"
    if obj.get("kind") != SHRED_KIND:
        raise VerificationError(f"{where}: not a key.shred entry")
    details = obj["details"]
    reason = details.get("reason")
    if not isinstance(reason, str) or not reason:
        raise VerificationError(f"{where}: details.reason is not a non-empty string")
    return ShredEntry(
        index=index,
        ts=obj["ts"],
        engine_id=_engine(details, where),
        command_id=_optional_int(details, "command_id", where),
        reason=reason,
        destroyed_epoch=_optional_int(details, "destroyed_epoch", where),
        entry_count=_int(details, "entry_count", where),
        bytes_deleted=_int(details, "bytes_deleted", where),
    )


def passed(z: ZeroizeEntry) -> bool:
    """Whether `z` passed its verification, or ran without one (rule 4 of the module docstring)."""
    return z.verified is not False and (z.verify_mode == "none") == (z.verified is None)


def check_clear(z: ZeroizeEntry) -> None:
    """A covering clear must have passed its verification, or have been run without one."""
    if not passed(z):
        raise VerificationError(
            f"entry {z.index}: verification result {z.verified!r} under mode {z.verify_mode!r}"
        )


# --- linking ----------------------------------------------------------------------------------------


def engines_in(purges: Iterable[PurgeEntry]) -> int:
    """How many engines `purges` stand for: one per (engine id, time), so the parts of one split
    entry count once (module docstring)."""
    return len({(p.engine_id, p.ts) for p in purges})


def same_engine(a: str | None, b: str | None) -> bool:
    """Rule 2 of the module docstring: equal ids, or one of them unknown (one id space)."""
    return a is None or b is None or a == b


def cover(purges: Iterable[PurgeEntry], zeroizes: Iterable[ZeroizeEntry]) -> Coverage:
    """Link every quarantined block of `purges` to its covering zeroize entry (module docstring)."""
    clears = sorted((z for z in zeroizes if not z.handover and passed(z)), key=lambda z: z.index)
    links: dict[tuple[int, int], int] = {}
    missing: dict[int, frozenset[int]] = {}
    for p in purges:
        left = set(p.block_ids)
        for z in clears:
            if not left:
                break
            if z.index <= p.index or not same_engine(p.engine_id, z.engine_id):
                continue
            for block in left & z.block_ids:
                links[(p.index, block)] = z.index
            left -= z.block_ids
        if left:
            missing[p.index] = frozenset(left)
    return Coverage(links, missing)


def counts_for(purge: PurgeEntry, shred: ShredEntry) -> bool:
    """Whether `shred` destroys one of `purge`'s offload keys (module docstring)."""
    return (
        shred.index > purge.index
        and shred.command_id == purge.command_id
        and shred.reason == SHRED_PURGE_REASON
        and same_engine(purge.engine_id, shred.engine_id)
    )


def cover_offload(purges: Iterable[PurgeEntry], shreds: Iterable[ShredEntry]) -> OffloadCoverage:
    """Link every purge entry with offload keys to the `key.shred` entries that destroyed them."""
    ordered = sorted(shreds, key=lambda s: s.index)
    links: dict[int, tuple[int, ...]] = {}
    missing: dict[int, int] = {}
    for p in purges:
        if p.tier_key_count <= 0:
            continue
        found = tuple(s.index for s in ordered if counts_for(p, s))
        links[p.index] = found
        if len(found) < p.tier_key_count:
            missing[p.index] = p.tier_key_count - len(found)
    return OffloadCoverage(links, missing)


# --- what the entries prove --------------------------------------------------------------------------


def _bytes_of(coverage: Coverage, zeroizes: dict[int, ZeroizeEntry], purge: PurgeEntry) -> int:
    """Bytes of `purge`'s blocks cleared: each covering entry's bytes per block, times its blocks."""
    per_entry: dict[int, int] = {}
    for block in purge.block_ids:
        z = coverage.links.get((purge.index, block))
        if z is not None:
            per_entry[z] = per_entry.get(z, 0) + 1
    return sum(
        zeroizes[z].bytes_cleared * n // len(zeroizes[z].block_ids) for z, n in per_entry.items()
    )


def engine_facts(
    purges: Sequence[PurgeEntry], zeroizes: Sequence[ZeroizeEntry], coverage: Coverage
) -> dict[str | None, dict[str, Any]]:
    """Per engine id (None: entries without one), what its purge entries and their clears show;
    `engines` is how many engines they stand for (`engines_in`: for None, one per distinct time)."""
    by_index = {z.index: z for z in zeroizes}
    out: dict[str | None, dict[str, Any]] = {}
    for p in purges:
        facts = out.setdefault(
            p.engine_id,
            {"purge_entries": 0, "blocks_quarantined": 0, "blocks_active_deferred": 0},
        )
        facts["purge_entries"] += 1
        facts["blocks_quarantined"] += len(p.block_ids)
        facts["blocks_active_deferred"] += p.blocks_active_doomed
        facts["bytes_cleared"] = facts.get("bytes_cleared", 0) + _bytes_of(coverage, by_index, p)
        devices = {
            by_index[z].device
            for b in p.block_ids
            if (z := coverage.links.get((p.index, b))) is not None
        }
        facts["devices"] = sorted(set(facts.get("devices", [])) | devices)
    for engine_id, facts in out.items():
        facts["engines"] = engines_in(p for p in purges if p.engine_id == engine_id)
    return out


def summary(
    purges: Sequence[PurgeEntry], zeroizes: Sequence[ZeroizeEntry], coverage: Coverage
) -> dict[str, Any]:
    """Totals, techniques, verification and times shown by the entries (complete coverage only)."""
    if not coverage.complete:
        raise VerificationError("not every quarantined block is covered by a zeroize entry")
    covering = set(coverage.zeroize_indices())
    used = [z for z in zeroizes if z.index in covering]
    for z in used:
        check_clear(z)
    facts = engine_facts(purges, zeroizes, coverage)
    verified = {z.verified for z in used}
    result = "passed" if verified == {True} else "not_verified" if verified == {None} else "partial"
    return {
        "kinds": sorted({p.kind for p in purges}),
        "blocks_quarantined": sum(f["blocks_quarantined"] for f in facts.values()),
        "blocks_active_deferred": sum(f["blocks_active_deferred"] for f in facts.values()),
        "bytes_cleared": sum(f["bytes_cleared"] for f in facts.values()),
        "methods": sorted({z.method for z in used}),
        "verify_modes": sorted({z.verify_mode for z in used}),
        "verification_result": result if used else "nothing_to_clear",
        "purged_first": min((p.ts for p in purges), default=None),
        "purged_last": max((p.ts for p in purges), default=None),
        "zeroized_first": min((z.ts for z in used), default=None),
        "zeroized_last": max((z.ts for z in used), default=None),
    }


def _shreds_used(shreds: Sequence[ShredEntry], coverage: OffloadCoverage) -> list[ShredEntry]:
    used = set(coverage.shred_indices())
    return sorted((s for s in shreds if s.index in used), key=lambda s: s.index)


def _offload_figures(shreds: Sequence[ShredEntry]) -> dict[str, Any]:
    return {
        "keys_destroyed": len(shreds),
        "entries_deleted": sum(s.entry_count for s in shreds),
        "bytes_deleted": sum(s.bytes_deleted for s in shreds),
        "key_shred_entries": [s.index for s in shreds],
    }


def offload_engine_facts(
    shreds: Sequence[ShredEntry], coverage: OffloadCoverage
) -> dict[str | None, dict[str, Any]]:
    """Per engine id (None: entries without one), what its linked `key.shred` entries show:
    `keys_destroyed`, `entries_deleted`, `bytes_deleted` and their ledger indices
    (`key_shred_entries`). Engines without offload keys to destroy are absent."""
    per_engine: dict[str | None, list[ShredEntry]] = {}
    for s in _shreds_used(shreds, coverage):
        per_engine.setdefault(s.engine_id, []).append(s)
    return {engine: _offload_figures(found) for engine, found in per_engine.items()}


def offload_summary(
    purges: Sequence[PurgeEntry], shreds: Sequence[ShredEntry], coverage: OffloadCoverage
) -> dict[str, Any] | None:
    """The offload totals (`_offload_figures` plus the first and last shred time), or None when no
    purge entry had offload keys to destroy (complete coverage only)."""
    if not coverage.complete:
        raise VerificationError("not every offload data key has a key.shred entry")
    if not any(p.tier_key_count > 0 for p in purges):
        return None
    used = _shreds_used(shreds, coverage)
    return {
        **_offload_figures(used),
        "shredded_first": min((s.ts for s in used), default=None),
        "shredded_last": max((s.ts for s in used), default=None),
    }
