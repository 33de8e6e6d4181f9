"""Find a purge job's evidence in the ledger database, and prove it against a signed checkpoint.

The linking rules are `kvguard.audit.erasure`'s; this module only fetches candidate entries:

- purge entries: entries of the four purge kinds from `since` on, whose `command_id` is the job;
- clears: for each purge entry, `block.zeroize` entries after it that list one of its blocks
  (through the block-link table) and passed their verification (`erasure.passed`), read in index
  order only until every block is covered;
- the request: the first `admin.action` entry that created the job (`purge.create`, or
  `tenant.disable` for the purge it queues) between `since` and `until`; `kvguard purge` records
  `purge.create` too (through the outbox), so every job has one, and a certificate without it does
  not verify;
- key shreds (engines with an offload tier): `key.shred` entries from `since` on whose `command_id`
  is the job, kept where they count for one of its purge entries (`erasure.cover_offload`). A
  `key.shred` leaf that does not parse is skipped: it proves nothing, and the job waits for the
  keys it should have proven.

Purge, request and key shred entries are found by job id through the command-link table
(`ledger_entry_commands`, one primary-key range read per job, `find_evidence` reads a page of jobs
at once), so the cost of a job's evidence is that of its own entries, whatever else the ledger holds
(issue 11: the scan of every purge entry since the job's creation took 18 s for a page of 100
jobs). Each found leaf is still parsed and checked against the rule above: a link only narrows the
search. `since` and `until` bound the entries' timestamps, which come from the engines' and the
API's clocks: callers pass the job's creation time widened by `CLOCK_SKEW_S`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, NamedTuple

import sqlalchemy as sa

from kvguard.audit import erasure, note
from kvguard.audit import schema as t
from kvguard.audit.certificate import REQUEST_ACTIONS
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.db import read_connection
from kvguard.audit.ledger import Ledger
from kvguard.audit.selection import ts_micros
from kvguard.errors import VerificationError

CLOCK_SKEW_S: Final = erasure.CLOCK_SKEW_S  # engines and the API keep time by NTP
_PAGE: Final = 500
_FIRST_CLEARS: Final = 16  # the first page of a purge's clears (they follow it closely)
_REQUEST_KIND: Final = "admin.action"
_JOBS_PER_READ: Final = 500  # bound the IN (...) list of one link read


@dataclass(frozen=True)
class JobEvidence:
    """The ledger entries of one purge job; `zeroizes` holds only the clears that cover a block,
    `shreds` only the `key.shred` entries that count for a purge entry (`offload`)."""

    purges: list[erasure.PurgeEntry]
    zeroizes: list[erasure.ZeroizeEntry]
    coverage: erasure.Coverage
    request: int | None
    leaves: dict[int, bytes] = field(repr=False)
    shreds: list[erasure.ShredEntry] = field(default_factory=list)
    offload: erasure.OffloadCoverage = erasure.NO_OFFLOAD

    def indices(self) -> list[int]:
        found = [p.index for p in self.purges] + [z.index for z in self.zeroizes]
        found += [s.index for s in self.shreds]
        return sorted(found + ([self.request] if self.request is not None else []))


@dataclass(frozen=True)
class Proven:
    """A signed checkpoint and the inclusion proof of each requested entry against it."""

    checkpoint: str
    tree_size: int
    proofs: dict[int, list[bytes]]


Window = tuple[datetime, datetime]  # (since, until) of one job's entries


class _Linked(NamedTuple):
    """An entry linked to a job, as read back."""

    idx: int
    ts_us: int
    leaf: bytes


def find_job_evidence(
    ledger: Ledger, job_id: int, *, since: datetime, until: datetime
) -> JobEvidence:
    """The evidence of job `job_id` recorded so far (see the module docstring)."""
    return find_evidence(ledger, {job_id: (since, until)})[job_id]


def find_evidence(ledger: Ledger, windows: Mapping[int, Window]) -> dict[int, JobEvidence]:
    """`find_job_evidence` of several jobs (job id -> its (since, until)), their purge and request
    entries read in one query: what listing a page of jobs costs."""
    with read_connection(ledger.store.engine) as conn:
        linked = _linked_entries(conn, sorted(windows))
        return {
            job_id: _evidence(conn, job_id, since, until, linked.get(job_id, []))
            for job_id, (since, until) in windows.items()
        }


def _linked_entries(conn: sa.Connection, job_ids: Sequence[int]) -> dict[int, list[_Linked]]:
    """The entries linked to each job, in index order."""
    found: dict[int, list[_Linked]] = {}
    for start in range(0, len(job_ids), _JOBS_PER_READ):
        chunk = list(job_ids[start : start + _JOBS_PER_READ])
        for job_id, idx, ts_us, leaf in conn.execute(_LINKED, {"jobs": chunk}):
            found.setdefault(int(job_id), []).append(_Linked(int(idx), int(ts_us), bytes(leaf)))
    return found


# `_linked_entries`'s statement, built once (an expanding parameter for the page's job ids):
# building it cost about as much CPU as running it.
_LINKED: Final = (
    sa.select(t.entry_commands.c.command_id, t.entries.c.idx, t.entries.c.ts_us, t.entries.c.leaf)
    .join(t.entries, t.entries.c.idx == t.entry_commands.c.idx)
    .where(t.entry_commands.c.command_id.in_(sa.bindparam("jobs", expanding=True)))
    .order_by(t.entry_commands.c.command_id, t.entry_commands.c.idx)
)


def _evidence(
    conn: sa.Connection, job_id: int, since: datetime, until: datetime, linked: Sequence[_Linked]
) -> JobEvidence:
    since_us, until_us = ts_micros(since), ts_micros(until)
    leaves: dict[int, bytes] = {}
    # (index, leaf, its JSON, whether before `until`) of each entry in the window, parsed once; a
    # leaf that is not an event (a row linked by another writer) proves nothing and is left out
    found = [
        (e.idx, e.leaf, obj, e.ts_us < until_us)
        for e in linked
        if e.ts_us >= since_us and (obj := _parsed(e.leaf)) is not None
    ]
    purges = []
    shreds: dict[int, tuple[erasure.ShredEntry, bytes]] = {}
    for index, leaf, obj, _ in found:
        kind = obj.get("kind")
        if obj["details"].get("command_id") != job_id:
            continue
        if kind in erasure.PURGE_KINDS:
            try:
                purges.append(erasure.purge_entry(index, obj))
            except VerificationError:
                continue  # malformed: not written by an engine, proves nothing
            leaves[index] = leaf
        elif kind == erasure.SHRED_KIND:
            try:
                shreds[index] = (erasure.shred_entry(index, obj), leaf)
            except VerificationError:
                continue
    candidates: dict[int, erasure.ZeroizeEntry] = {}
    for p in purges:
        candidates.update(_clears_for(conn, p, leaves))
    request = None
    for index, leaf, obj, before_until in found:  # the first one, as the certificate names one
        if before_until and _is_request(obj, job_id):
            request, leaves[index] = index, leaf
            break
    coverage = erasure.cover(purges, candidates.values())
    used = coverage.zeroize_indices()
    offload = erasure.cover_offload(purges, (entry for entry, _ in shreds.values()))
    shredded = offload.shred_indices()
    for i in shredded:
        leaves[i] = shreds[i][1]
    kept = [p.index for p in purges] + used + shredded + ([request] if request is not None else [])
    return JobEvidence(
        purges=purges,
        zeroizes=[candidates[i] for i in used],
        coverage=coverage,
        request=request,
        leaves={i: leaves[i] for i in kept},
        shreds=[shreds[i][0] for i in shredded],
        offload=offload,
    )


def _parsed(leaf: bytes) -> dict[str, Any] | None:
    """The leaf's event JSON, or None for a leaf that is not a canonical version-1 event: a row
    that something other than kvguard put at the head of the log, and linked to a job or to a
    purge's blocks (a role holding INSERT can), proves nothing and must not stop a certificate
    (docs/audit.md, Trust model)."""
    try:
        return erasure.parse_leaf(leaf)
    except VerificationError:
        return None


def _is_request(obj: dict[str, Any], job_id: int) -> bool:
    """Whether a leaf is the successful request (`purge.create`, `tenant.disable`) of the job."""
    if obj.get("kind") != _REQUEST_KIND:
        return False
    details = obj["details"]
    name = REQUEST_ACTIONS.get(details.get("action", ""))
    return name is not None and details.get("outcome") == "ok" and details.get(name) == job_id


def _scan(
    conn: sa.Connection, params: dict[str, Any], first_page: int = _PAGE
) -> Iterator[tuple[int, bytes]]:
    """(index, leaf) of every row of `_CLEARS` with `params` (in index order), a page at a time:
    `first_page` rows first, then twice as many per page up to `_PAGE`."""
    after, page = int(params["purge_index"]), first_page
    while True:
        rows = conn.execute(_CLEARS, {**params, "after": after, "page": page}).all()
        for idx, leaf in rows:
            yield int(idx), bytes(leaf)
        if len(rows) < page:
            return
        after, page = int(rows[-1][0]), min(2 * page, _PAGE)


# The zeroize entries after a purge entry that list one of its blocks, one page after `after`:
# built once (it was built for every purge entry of every job a listing showed, at about the CPU
# of running it). Bind parameters: `blocks` (expanding), `purge_index`, `after`, `page`.
_CLEARS: Final = (
    sa.select(t.entries.c.idx, t.entries.c.leaf)
    .where(
        t.entries.c.kind == erasure.ZEROIZE_KIND,
        t.entries.c.idx > sa.bindparam("after", type_=sa.BigInteger),
        t.entries.c.idx.in_(
            sa.select(t.entry_blocks.c.idx).where(
                t.entry_blocks.c.block_id.in_(sa.bindparam("blocks", expanding=True)),
                t.entry_blocks.c.idx > sa.bindparam("purge_index", type_=sa.BigInteger),
            )
        ),
    )
    .order_by(t.entries.c.idx)
    .limit(sa.bindparam("page", type_=sa.Integer))
)


def _clears_for(
    conn: sa.Connection, purge: erasure.PurgeEntry, leaves: dict[int, bytes]
) -> dict[int, erasure.ZeroizeEntry]:
    """Zeroize entries after `purge` listing its blocks, in index order, until all are covered.

    Reading stops at the entry that covers the last uncovered block: `erasure.cover` links each
    block to the first covering entry, so later ones cannot change the evidence. A purge's blocks
    are cleared at the engine's next step, so the first short page usually holds them all.
    """
    found: dict[int, erasure.ZeroizeEntry] = {}
    if not purge.block_ids:
        return found
    params = {"blocks": sorted(purge.block_ids), "purge_index": purge.index}
    uncovered = set(purge.block_ids)
    for index, leaf in _scan(conn, params, first_page=_FIRST_CLEARS):
        obj = _parsed(leaf)
        try:
            z = erasure.zeroize_entry(index, obj) if obj is not None else None
        except VerificationError:
            z = None
        if z is None:
            continue  # not an engine's clear (written outside kvguard): clears nothing
        # A clear that failed its read-back covers nothing (`erasure.cover`, rule 4): reading
        # goes on to the clear that passed, or the job waits for one.
        if (
            not z.handover
            and erasure.passed(z)
            and erasure.same_engine(purge.engine_id, z.engine_id)
        ):
            found[index] = z
            leaves[index] = leaf
            uncovered -= z.block_ids
            if not uncovered:
                break
    return found


def prove(ledger: Ledger, indices: Sequence[int]) -> Proven:
    """Inclusion proofs of `indices` against the latest checkpoint if it covers them all, else
    against a freshly signed one."""
    with ledger.store.engine.connect() as conn:
        latest = ledger.trusted_checkpoint(conn)
    needed = max(indices, default=-1) + 1
    if latest is not None and latest.size >= max(needed, 1):
        signed, size = latest.note, latest.size
    else:
        signed = ledger.checkpoint()
        size = parse_checkpoint(note.split_note(signed)[0]).size
    return Proven(signed, size, {i: ledger.inclusion_proof(i, size) for i in indices})
