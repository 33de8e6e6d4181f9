"""Appends of a few entries and bulk appends take different paths on PostgreSQL (pipelined
multi-row INSERTs up to `_PG_PIPELINED_MAX_ENTRIES`, COPY above it, `kvguard.audit.store`): both
must store the same rows, hashes and links, in any order of sizes, and a second store must go on
from either."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from kvguard.audit import schema as t
from kvguard.audit.events import AuditEvent
from kvguard.audit.ledger import Ledger
from kvguard.audit.store import _PG_PIPELINED_MAX_ENTRIES

from .conftest import make_event

Opener = Callable[..., Ledger]
SIZES = (
    1,
    _PG_PIPELINED_MAX_ENTRIES,
    _PG_PIPELINED_MAX_ENTRIES + 1,
    3,
    2 * _PG_PIPELINED_MAX_ENTRIES,
)


def _event(i: int) -> AuditEvent:
    return make_event(i, payload={"tenant_id": f"t{i % 3}"}) if i % 2 else make_event(i)


def test_small_and_bulk_appends_store_one_verifying_ledger(
    db_url: str, open_ledger: Opener
) -> None:
    ledger = open_ledger(db_url)
    start = 0
    for n in SIZES:
        batch = [_event(i) for i in range(start, start + n)]
        assert ledger.append_many(batch) == list(range(start, start + n))
        start += n
    other = open_ledger(db_url)  # another process: its frontier comes from the stored hashes
    assert other.append_many([_event(start), _event(start + 1)]) == [start, start + 1]
    assert ledger.append(make_event(start + 2)) == start + 2  # and the first one reloads it
    ledger.checkpoint()
    report = ledger.verify()
    assert (report.size, report.payloads) == (start + 3, sum(1 for i in range(start + 2) if i % 2))
    with sa.create_engine(db_url).connect() as conn:
        blocks = conn.execute(sa.select(sa.func.count()).select_from(t.entry_blocks)).scalar_one()
    assert blocks == sum(len({i % 97, (i * 7) % 97}) for i in range(start + 3))
