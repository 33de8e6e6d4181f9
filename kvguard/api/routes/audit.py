"""`/v1/audit`: ledger queries, entries with inclusion proofs, checkpoints, consistency proofs, exports.

Tenant scoping comes from `Access.ledger_tags` / `Access.may_see_entry` (kvguard.api.deps): a
tenant_admin reads only entries carrying its tenant's scope tags and gets 404 for anything else, as
for an entry that does not exist. Checkpoints and proofs carry no tenant data: every role reads them.
Exports are audited (`audit.export`) before the first byte is sent; signing a checkpoint on demand
is an admin action (`audit.checkpoint`) whose entry the checkpoint itself covers.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Literal

import sqlalchemy as sa
from fastapi import APIRouter, Path, Query
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, AwareDatetime

from kvguard.api.audit_schemas import (
    CheckpointPage,
    CheckpointPublic,
    ConsistencyProof,
    EntryPage,
    EntryProof,
    EntryPublic,
    b64_list,
)
from kvguard.api.deps import ADMINS, READERS, Access, Action, audited, require
from kvguard.api.errors import ERROR_RESPONSES
from kvguard.api.offload import OneHopRoute
from kvguard.audit import bundle, note
from kvguard.audit.bundle_stream import BundleStream, ExportQuery
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.checkpoint_rows import retired_key_row
from kvguard.audit.events import EventKind
from kvguard.audit.leaf import format_ts
from kvguard.audit.ledger import Ledger
from kvguard.audit.query import LedgerRecord, checkpoint_at, checkpoint_page
from kvguard.audit.store import CheckpointRow
from kvguard.control.tenants import TENANT_ID_PATTERN
from kvguard.errors import FailClosedError, NotFoundError, VerificationError

router = APIRouter(
    route_class=OneHopRoute, prefix="/v1/audit", tags=["audit"], responses=ERROR_RESPONSES
)

_MAX_INDEX = 1 << 62
Readers = Annotated[Access, require(*READERS)]
TenantQuery = Annotated[
    str | None,
    Query(
        pattern=TENANT_ID_PATTERN,
        max_length=128,
        description="Only this tenant's entries (a tenant_admin: its own tenant only)",
    ),
]
KindQuery = Annotated[
    list[EventKind] | None, Query(description="Only these kinds (repeat the parameter)")
]


def _in_utc(value: datetime | None) -> datetime | None:
    """The instant in UTC. One that UTC cannot express (`0001-01-01T00:00:00+14:00` is in year 0
    there) overflows the ledger's timestamp arithmetic: a 422 naming the field, not a 500."""
    if value is None:
        return None
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("must be an instant between years 1 and 9999 in UTC") from None


SinceQuery = Annotated[
    AwareDatetime | None,
    AfterValidator(_in_utc),
    Query(description="Entries at or after this instant (ISO 8601 with a zone, e.g. `Z`)"),
]
UntilQuery = Annotated[
    AwareDatetime | None,
    AfterValidator(_in_utc),
    Query(description="Entries before this instant"),
]


@router.get("/entries", response_model=EntryPage)
def list_entries(
    *,
    access: Readers,
    tenant_id: TenantQuery = None,
    kind: KindQuery = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
    request_id: Annotated[str | None, Query(max_length=128, pattern=r"^[\x21-\x7e]+$")] = None,
    block_id: Annotated[int | None, Query(ge=0, lt=1 << 63)] = None,
    cursor: Annotated[
        int | None,
        Query(
            ge=0,
            lt=_MAX_INDEX,
            description="`next_cursor` of the previous page: continue after this entry index",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EntryPage:
    """Ledger entries in index order, filtered; a tenant_admin sees only its tenant's."""
    page = access.services.ledger.query(
        scope_tags=access.ledger_tags(tenant_id),
        kinds=kind,
        since=since,
        until=until,
        request_id=request_id,
        block_id=block_id,
        after=cursor,
        limit=limit,
    )
    return EntryPage(entries=[EntryPublic.of(r) for r in page.records], next_cursor=page.next_after)


@router.get("/entries/{index}", response_model=EntryProof)
def get_entry(
    access: Readers,
    index: Annotated[int, Path(ge=0, lt=_MAX_INDEX)],
    tree_size: Annotated[
        int | None,
        Query(
            ge=1,
            lt=_MAX_INDEX,
            description="Prove against this tree size instead of the "
            "latest checkpoint (index < tree_size <= ledger size)",
        ),
    ] = None,
) -> EntryProof:
    """One entry, its leaf and its inclusion proof against the latest checkpoint that covers it
    (or `tree_size`), with that checkpoint's signed note. Only checkpoints this log signed are
    used (`_servable`): for any other stored row of that size the entry is proved against the
    computed root, with no note."""
    ledger = access.services.ledger
    record = _entry(access, index)
    with ledger.store.engine.connect() as conn:
        if tree_size is not None:
            if not index < tree_size <= ledger.size:
                raise ValueError(
                    f"query.tree_size: must be above the index ({index}) and at most the "
                    f"ledger size ({ledger.size})"
                )
            row = checkpoint_at(conn, tree_size)
            if row is not None and not _servable(ledger, conn, row):
                row = None  # not this log's: the computed root, unsigned
        else:
            row = _newest_servable(ledger, conn)
            if row is None or row.size <= index:
                row = None  # not yet covered: prove against the current tree, unsigned
        size = row.size if row is not None else tree_size or ledger.size
    proof = ledger.inclusion_proof(index, size)
    root = row.root if row is not None else ledger.root(size)
    return EntryProof(
        entry=EntryPublic.of(record),
        leaf=bundle.b64(record.leaf),
        tree_size=size,
        root=bundle.b64(root),
        inclusion_proof=b64_list(proof),
        checkpoint=row.note if row is not None else None,
    )


def _entry(access: Access, index: int) -> LedgerRecord:
    """Entry `index` if it exists and the caller may see it; 404 (the same answer) otherwise."""
    page = access.services.ledger.query(after=index - 1, limit=1)
    if not page.records or page.records[0].index != index:
        raise NotFoundError(f"entry {index} not found")
    record = page.records[0]
    if not access.may_see_entry(json.loads(record.leaf)["scope_tag"]):
        raise NotFoundError(f"entry {index} not found")
    return record


@router.get("/checkpoints/latest", response_model=CheckpointPublic)
def latest_checkpoint(access: Readers) -> CheckpointPublic:
    """The latest checkpoint this log signed (404 before the first one): its keys' signature
    verifies, or, after a finished key rotation, a retired key's whose root the stored tree
    reproduces. Other stored rows (anyone who may write the database can insert one) are
    skipped."""
    return CheckpointPublic.of(_latest(access))


def _latest(access: Access) -> CheckpointRow:
    ledger = access.services.ledger
    with ledger.store.engine.connect() as conn:
        row = _newest_servable(ledger, conn)
    if row is None:
        raise NotFoundError("no checkpoint signed by this log yet")
    return row


# Rows above the newest one this log's keys verify that are checked as a retired key's (each costs
# a root computed from the stored hashes): enough for the checkpoints of a finished rotation.
_RETIRED_LOOKBACK = 8


def _servable(ledger: Ledger, conn: sa.Connection, row: CheckpointRow) -> bool:
    """Whether a reader may be given stored checkpoint `row`: this log's keys verify it, or it
    is a retired key's for this origin whose root the stored tree reproduces (no trust granted:
    the reader checks the note with the key it holds; a made-up root is never served)."""
    if ledger.checkpoint_row_problem(row) is None:
        return True
    ours = ledger.verifiers()
    return retired_key_row(ledger.store, conn, row, origin=ledger.origin, ours=ours)


def _newest_servable(ledger: Ledger, conn: sa.Connection) -> CheckpointRow | None:
    """The newest `_servable` row: the signer's trusted checkpoint, or one of the few rows above
    it that a retired key signed. Reads log nothing about skipped rows (the signer does, once per
    checkpoint) and a row of ours for another origin is a misconfiguration (503)."""
    try:
        trusted = ledger.trusted_checkpoint(conn, log=False)
    except VerificationError as exc:
        raise FailClosedError(f"the ledger's checkpoints cannot be served: {exc}") from None
    floor = trusted.size if trusted is not None else 0
    ours = ledger.verifiers()
    for n, row in enumerate(ledger.store.checkpoints_newest_first(conn)):
        if row.size <= floor or n >= _RETIRED_LOOKBACK:
            break
        if retired_key_row(ledger.store, conn, row, origin=ledger.origin, ours=ours):
            return row
    return trusted


@router.get("/checkpoints", response_model=CheckpointPage)
def list_checkpoints(
    access: Readers,
    cursor: Annotated[
        int | None, Query(ge=0, lt=_MAX_INDEX, description="Continue after this tree size")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> CheckpointPage:
    """Every stored checkpoint, oldest first, as stored: rows are not checked here (anyone who
    may write the database can insert one, and `prev_size` chains to whatever row was stored
    before); verify each note with the log's verifier key. `/checkpoints/latest` serves only
    this log's."""
    with access.services.ledger.store.engine.connect() as conn:
        rows, after = checkpoint_page(conn, after=cursor, limit=limit)
    return CheckpointPage(checkpoints=[CheckpointPublic.of(r) for r in rows], next_cursor=after)


@router.post("/checkpoints", response_model=CheckpointPublic)
def sign_checkpoint(
    action: Annotated[Action, audited("audit.checkpoint", *ADMINS)],
) -> CheckpointPublic:
    """Sign a checkpoint now (admin), over the tree that ends with this call's `admin.action`
    entry: the request and the checkpoint are stored in one ledger transaction, so the checkpoint
    covers who asked for it (entry index = tree size - 1), and a request that cannot be recorded
    signs nothing (its failure goes to the outbox, as every failed call's does)."""
    ledger = action.access.services.ledger
    signed = ledger.checkpoint_recorded(action.ok_event())
    action.recorded()
    size = parse_checkpoint(note.split_note(signed)[0]).size
    with ledger.store.engine.connect() as conn:
        row = checkpoint_at(conn, size)
    if row is None:  # the ledger stores the first checkpoint of every size it signs
        raise NotFoundError(f"checkpoint of size {size} not found")
    return CheckpointPublic.of(row)  # signed under the head lock: no other row of its size


@router.get("/consistency", response_model=ConsistencyProof)
def consistency(
    access: Readers,
    old_size: Annotated[int, Query(ge=1, lt=_MAX_INDEX)],
    new_size: Annotated[
        int | None,
        Query(ge=1, lt=_MAX_INDEX, description="Default: the latest checkpoint's size"),
    ] = None,
) -> ConsistencyProof:
    """RFC 9162 proof that the tree of `old_size` is a prefix of the tree of `new_size`."""
    ledger = access.services.ledger
    new = new_size if new_size is not None else _latest(access).size
    if new > ledger.size:
        raise ValueError(f"query.new_size: at most the ledger size ({ledger.size})")
    if old_size > new:
        raise ValueError(f"query.old_size: at most new_size ({new})")
    proof = ledger.consistency_proof(old_size, new)
    return ConsistencyProof(old_size=old_size, new_size=new, proof=b64_list(proof))


@router.get(
    "/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-tar": {}, "application/gzip": {}}}},
)
def export(
    *,
    action: Annotated[Action, audited("audit.export", *READERS)],
    tenant_id: TenantQuery = None,
    kind: KindQuery = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
    format: Annotated[
        Literal["tar", "tar.gz"], Query(description="tar, or tar compressed with gzip")
    ] = "tar",
) -> StreamingResponse:
    """A streamed export bundle (the `kvguard audit export` format, see docs/api.md): a tar of
    one directory that `kvguard verify DIR --key VKEY` checks offline."""
    access, services = action.access, action.access.services
    tags = access.ledger_tags(tenant_id)
    action.tenant_id = access.one_tenant_or_all(tenant_id)
    query = ExportQuery(scope_tags=tags, kinds=kind, since=since, until=until)
    stream = BundleStream(
        services.ledger, query, gzip=format == "tar.gz", mtime=int(services.clock())
    )
    action.done(
        None,
        tree_size=stream.tree_size,
        kinds=",".join(sorted({str(k) for k in kind})) if kind else None,
        since=format_ts(since) if since else None,
        until=format_ts(until) if until else None,
        format=format,
        entries=None,  # counted only while streaming; the bundle itself says how many
    )
    return StreamingResponse(
        iter(stream),
        media_type=stream.media_type,
        headers={"Content-Disposition": f'attachment; filename="{stream.filename}"'},
    )
