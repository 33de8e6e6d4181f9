"""Find a purge job's evidence in the ledger database, and prove it against a signed checkpoint.

The linking rules are `kvguard.audit.erasure`'s; this module only fetches candidate entries:

- purge entries: entries of the four purge kinds from `since` on, whose `command_id` is the job;
- clears: for each purge entry, `block.zeroize` entries after it that list one of its blocks
  (through the block-link table), read in index order only until every block is covered;
- the request: the `admin.action` entry that created the job (`purge.create`, or `tenant.disable`
  for the purge it queues), searched between `since` and `until`; jobs queued by the command line
  have none.

`since` and `until` bound the search by the entries' timestamps, which come from the engines' and
the API's clocks: callers pass the job's creation time widened by `CLOCK_SKEW_S`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

import sqlalchemy as sa

from kvguard.audit import erasure, note
from kvguard.audit import schema as t
from kvguard.audit.certificate import REQUEST_ACTIONS
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.ledger import Ledger
from kvguard.audit.query import select_indices

CLOCK_SKEW_S: Final = timedelta(minutes=5)  # engines and the API keep time by NTP
_PAGE: Final = 500


@dataclass(frozen=True)
class JobEvidence:
    """The ledger entries of one purge job; `zeroizes` holds only the clears that cover a block."""

    purges: list[erasure.PurgeEntry]
    zeroizes: list[erasure.ZeroizeEntry]
    coverage: erasure.Coverage
    request: int | None
    leaves: dict[int, bytes] = field(repr=False)

    def indices(self) -> list[int]:
        found = [p.index for p in self.purges] + [z.index for z in self.zeroizes]
        return sorted(found + ([self.request] if self.request is not None else []))


@dataclass(frozen=True)
class Proven:
    """A signed checkpoint and the inclusion proof of each requested entry against it."""

    checkpoint: str
    tree_size: int
    proofs: dict[int, list[bytes]]


def find_job_evidence(
    ledger: Ledger, job_id: int, *, since: datetime, until: datetime
) -> JobEvidence:
    """The evidence of job `job_id` recorded so far (see the module docstring)."""
    leaves: dict[int, bytes] = {}
    with ledger.store.engine.connect() as conn:
        purges = []
        for index, leaf in _scan(conn, select_indices(kinds=erasure.PURGE_KINDS, since=since)):
            obj = erasure.parse_leaf(leaf)
            if obj["details"].get("command_id") == job_id:
                purges.append(erasure.purge_entry(index, obj))
                leaves[index] = leaf
        candidates: dict[int, erasure.ZeroizeEntry] = {}
        for p in purges:
            candidates.update(_clears_for(conn, p, leaves))
        request = _request_index(conn, job_id, since, until, leaves)
    coverage = erasure.cover(purges, candidates.values())
    used = coverage.zeroize_indices()
    return JobEvidence(
        purges=purges,
        zeroizes=[candidates[i] for i in used],
        coverage=coverage,
        request=request,
        leaves={
            i: leaves[i]
            for i in [p.index for p in purges] + used + ([request] if request is not None else [])
        },
    )


def _scan(conn: sa.Connection, stmt: sa.Select[Any]) -> Iterator[tuple[int, bytes]]:
    """(index, leaf) of every row of `stmt` (ordered by index), a page at a time."""
    after = -1
    while True:
        rows = conn.execute(stmt.where(t.entries.c.idx > after).limit(_PAGE)).all()
        for idx, leaf in rows:
            yield int(idx), bytes(leaf)
        if len(rows) < _PAGE:
            return
        after = int(rows[-1][0])


def _clears_for(
    conn: sa.Connection, purge: erasure.PurgeEntry, leaves: dict[int, bytes]
) -> dict[int, erasure.ZeroizeEntry]:
    """Zeroize entries after `purge` listing its blocks, in index order, until all are covered."""
    found: dict[int, erasure.ZeroizeEntry] = {}
    if not purge.block_ids:
        return found
    links = sa.select(t.entry_blocks.c.idx).where(
        t.entry_blocks.c.block_id.in_(sorted(purge.block_ids))
    )
    stmt = select_indices(kinds=[erasure.ZEROIZE_KIND], after=purge.index).where(
        t.entries.c.idx.in_(links)
    )
    for number, (index, leaf) in enumerate(_scan(conn, stmt), start=1):
        z = erasure.zeroize_entry(index, erasure.parse_leaf(leaf))
        if not z.handover and erasure.same_engine(purge.engine_id, z.engine_id):
            found[index] = z
            leaves[index] = leaf
        if number % _PAGE == 0 and erasure.cover([purge], found.values()).complete:
            break
    return found


def _request_index(
    conn: sa.Connection, job_id: int, since: datetime, until: datetime, leaves: dict[int, bytes]
) -> int | None:
    stmt = select_indices(kinds=["admin.action"], since=since, until=until)
    for index, leaf in _scan(conn, stmt):
        details = erasure.parse_leaf(leaf)["details"]
        name = REQUEST_ACTIONS.get(details.get("action", ""))
        if name is not None and details.get("outcome") == "ok" and details.get(name) == job_id:
            leaves[index] = leaf
            return index
    return None


def prove(ledger: Ledger, indices: Sequence[int]) -> Proven:
    """Inclusion proofs of `indices` against the latest checkpoint if it covers them all, else
    against a freshly signed one."""
    with ledger.store.engine.connect() as conn:
        latest = ledger.store.latest_checkpoint(conn)
    needed = max(indices, default=-1) + 1
    if latest is not None and latest.size >= max(needed, 1):
        signed, size = latest.note, latest.size
    else:
        signed = ledger.checkpoint()
        size = parse_checkpoint(note.split_note(signed)[0]).size
    return Proven(signed, size, {i: ledger.inclusion_proof(i, size) for i in indices})
