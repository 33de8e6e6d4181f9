"""The ledger's SQL store: gapless appends under the head-row lock, stored hashes, checkpoints.

Append protocol (ARCHITECTURE.md, "Gapless indices"), in one transaction:
1. lock the head row (`BEGIN IMMEDIATE` on SQLite, `SELECT ... FOR UPDATE` on PostgreSQL);
2. if another process appended meanwhile, reload the in-memory frontier from O(log n) stored hashes;
3. insert entries, block links, command links, payloads and every newly completed subtree hash;
   inserting an entry advances the head (a trigger, migration 0004: the database accepts an entry
   only at `idx = head.size` and moves the head with it, so nothing else can move it);
4. commit (durably: see `kvguard.audit.db`).
The frontier is swapped in only after the commit, so a failed transaction leaves nothing behind.
On PostgreSQL an append of a `Claim` (the outbox drain) sends steps 1-2 with its own read, and step
3 with its own mark and the commit, as two pipelines: two round trips under the lock
(`_append_claimed`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any, NamedTuple, Protocol

import sqlalchemy as sa

from kvguard.audit import merkle
from kvguard.audit import schema as t
from kvguard.audit.db import write_transaction
from kvguard.errors import VerificationError
from kvguard.logging import get_logger

_log = get_logger("kvguard.audit.store")

_IN_CHUNK = 500  # bound the IN (...) list of one hash read
_CHECKPOINT_PAGE = 16  # checkpoint rows read at a time when looking for the latest trusted one
# Appends of up to this many entries go as pipelined INSERTs on PostgreSQL, larger ones by COPY
# (several times faster in bulk, docs/benchmarks.md "Audit ledger"; `_insert_pipelined`).
_PG_PIPELINED_MAX_ENTRIES = 64
# The frontier of the locked head's size when it is not the size this process knows (another process
# appended): the complete subtrees of its binary expansion, level k at position (size >> k) - 1, largest
# first (`merkle.range_subtrees(0, size)`; keys as `merkle.stored_hash_key`). Sent in the lock's
# pipeline, after the lock; a missing hash reads NULL and the append rebuilds it (`_load_frontier`).
# (48: `merkle.LEVEL_SHIFT`, tested.)
_PG_FRONTIER_SQL = (
    "SELECT g.k, CASE WHEN g.k = 0 "
    "THEN (SELECT e.leaf_hash FROM ledger_entries e WHERE e.idx = h.size - 1) "
    "ELSE (SELECT x.hash FROM ledger_hashes x "
    "WHERE x.id = (g.k::bigint << 48) | ((h.size >> g.k) - 1)) END "
    "FROM ledger_head h CROSS JOIN generate_series(0, 47) AS g(k) "
    "WHERE h.id = 1 AND h.size <> %s AND ((h.size >> g.k) & 1) = 1 ORDER BY g.k DESC"
)
_PG_LOCK_SQL = "SELECT size FROM ledger_head WHERE id = 1 FOR UPDATE"
_SQLITE_MAX_PARAMS = 999  # SQLITE_MAX_VARIABLE_NUMBER before SQLite 3.32 (32,766 since)
# Links that SQLite's triggers do not check (several per entry; migration 0004): a row planted ahead
# of the head is ignored rather than colliding with the append.
_IGNORED_ON_SQLITE = frozenset({"ledger_entry_blocks", "ledger_entry_commands"})


def blob(value: object, what: str) -> bytes:
    """A BLOB column's value as bytes. SQLite keeps whatever type a hand edit stores (`UPDATE ...
    SET leaf = '{...}'` stores TEXT): that is tampering to name, never a TypeError to crash on."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise VerificationError(
        f"{what} is not binary (stored as {type(value).__name__}: edited outside kvguard?)"
    )


class PreparedEntry(NamedTuple):
    """Everything about one entry that does not depend on its index (computed outside the lock)."""

    leaf: bytes
    leaf_hash: bytes
    kind: str
    scope_tag: str | None
    request_id: str | None
    ts_us: int
    block_ids: Sequence[int]
    payload: tuple[bytes, bytes] | None  # (salt, canonical body)
    command_ids: Sequence[int] = ()  # purge jobs the entry belongs to (`leaf.command_links`)


class CheckpointRow(NamedTuple):
    size: int
    root: bytes
    note: str
    prev_size: int | None


AfterAppend = Callable[[sa.Connection, int], None]
Collect = Callable[[sa.Connection], Sequence[PreparedEntry]]
Rows = Sequence[tuple[object, ...]]


class Claim(Protocol):
    """What an append reads and marks in its own transaction (`append_collected`), given also as
    PostgreSQL driver SQL (`%s` parameters) so that the append sends it with its lock and with its
    inserts: two round trips under the head lock instead of six or seven. Each round trip needs
    the appending thread back on the GIL and a core while every other drainer waits for the lock
    (docs/benchmarks.md, "Outbox drains in two round trips"). `collect` and `after` are the same
    work through SQLAlchemy, for SQLite."""

    def collect(self, conn: sa.Connection) -> Sequence[PreparedEntry]:
        """`Collect`: the entries to append, read in the append's transaction."""
        ...

    def after(self, conn: sa.Connection, first: int) -> None:
        """`AfterAppend`: marks what was appended, in the same transaction (raises to refuse)."""
        ...

    def select(self) -> tuple[str, Sequence[object]]:
        """The query `collect` runs, sent right after the head lock (a fresh READ COMMITTED
        snapshot: it sees every commit made before the lock was granted)."""
        ...

    def take(self, rows: Rows) -> Sequence[PreparedEntry]:
        """The entries to append, from the query's rows."""
        ...

    def mark(self, first: int) -> tuple[str, Sequence[object]]:
        """The statement `after` runs, sent after the inserts and before COMMIT in one pipeline:
        where `after` would raise, it must fail in the database with a division by zero, so that
        the pipeline aborts and the COMMIT never runs."""
        ...

    def refused(self) -> Exception:
        """What to raise when `mark` failed so (nothing was appended)."""
        ...


class LedgerStore:
    """Owns the ledger tables of one database; safe to share between threads of one process."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._frontier = merkle.Frontier(0, [])

    # -- reads ---------------------------------------------------------------------------------

    def size(self, conn: sa.Connection | None = None) -> int:
        stmt = sa.select(t.head.c.size).where(t.head.c.id == 1)
        if conn is not None:
            return _head_size(conn.execute(stmt).scalar_one_or_none())
        with self.engine.connect() as c:
            return _head_size(c.execute(stmt).scalar_one_or_none())

    def reader(self, conn: sa.Connection) -> merkle.HashReader:
        """A `merkle.HashReader` over the stored hashes, within `conn`'s transaction."""

        def read(subtrees: Sequence[merkle.Subtree]) -> list[bytes]:
            leaves = [s.position for s in subtrees if s.level == 0]
            nodes = [t.hash_key(s.level, s.position) for s in subtrees if s.level > 0]
            found_leaves = _select_in(
                conn, "SELECT idx, leaf_hash FROM ledger_entries", "idx", leaves
            )
            found_nodes = _select_in(conn, "SELECT id, hash FROM ledger_hashes", "id", nodes)
            out: list[bytes] = []
            for s in subtrees:
                h = (
                    found_leaves.get(s.position)
                    if s.level == 0
                    else found_nodes.get(t.hash_key(s.level, s.position))
                )
                if h is None:
                    raise VerificationError(f"stored hash of subtree {tuple(s)} is missing")
                out.append(h)
            return out

        return read

    def hashes_for_ranges(self, ranges: Sequence[tuple[int, int]], tree_size: int) -> list[bytes]:
        """Proof hashes for `ranges` of the tree of `tree_size` (ValueError if beyond the log).

        The proof path is the latency-critical read (target < 1 ms at 1M entries): one round trip
        of plain driver SQL reads the head size and every O(log n) stored hash at once; through
        SQLAlchemy's result machinery the same reads cost about 1 ms of CPU (profiled).
        """
        wanted = sorted({s for lo, hi in ranges for s in merkle.range_subtrees(lo, hi)})
        leaves = [s.position for s in wanted if s.level == 0]
        nodes = [t.hash_key(s.level, s.position) for s in wanted if s.level > 0]
        with self.engine.connect() as conn:
            mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
            parts = ["SELECT 2, size, NULL FROM ledger_head WHERE id = 1"]
            for select, keys in (
                ("SELECT 0, idx, leaf_hash FROM ledger_entries WHERE idx", leaves),
                ("SELECT 1, id, hash FROM ledger_hashes WHERE id", nodes),
            ):
                if keys:
                    parts.append(f"{select} IN ({', '.join(mark for _ in keys)})")
            cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                cursor.execute(" UNION ALL ".join(parts), (*leaves, *nodes))
                rows = cursor.fetchall()
            finally:
                cursor.close()
        sizes = [int(k) for kind, k, _ in rows if kind == 2]
        size = _head_size(sizes[0] if sizes else None)
        if tree_size > size:
            raise ValueError(f"tree size {tree_size} is beyond the ledger ({size} entries)")
        found = {
            (int(kind), int(k)): blob(v, f"stored hash {k}") for kind, k, v in rows if kind != 2
        }

        def key(s: merkle.Subtree) -> tuple[int, int]:
            return (0, s.position) if s.level == 0 else (1, t.hash_key(s.level, s.position))

        missing = [s for s in wanted if key(s) not in found]
        if missing:  # e.g. completed by a row another writer put at the head: one more connection
            with self.engine.connect() as again:
                found.update(
                    zip(map(key, missing), self.complete_reader(again)(missing), strict=True)
                )
        return merkle.hashes_for_ranges(ranges, lambda subtrees: [found[key(s)] for s in subtrees])

    def leaf_hashes(self, conn: sa.Connection, lo: int, hi: int) -> list[bytes]:
        """The stored leaf hashes of entries [lo, hi) in order (VerificationError if any is
        missing)."""
        e = t.entries.c
        stmt = sa.select(e.idx, e.leaf_hash).where(e.idx >= lo, e.idx < hi).order_by(e.idx)
        out = [
            blob(h, f"entry {i}: leaf hash")
            for i, h in conn.execute(stmt.execution_options(yield_per=10_000))
        ]
        if len(out) != hi - lo:
            raise VerificationError(f"entries {lo}..{hi - 1}: {hi - lo - len(out)} are missing")
        return out

    def complete_reader(self, conn: sa.Connection) -> merkle.HashReader:
        """`reader`, but a stored subtree hash that is missing is computed from the leaf hashes
        (VerificationError only if a leaf is missing): a row some other writer put at the head
        completes a subtree without storing its hash, and reads (checkpoints, proofs, exports)
        must not stop until the next append stores it (`_load_frontier`). The stored hashes are
        a cache of what the leaves give, so computing one proves the same thing."""
        strict = self.reader(conn)

        def read(subtrees: Sequence[merkle.Subtree]) -> list[bytes]:
            try:
                return list(strict(subtrees))
            except VerificationError:
                return [self._stored_or_computed(conn, strict, s) for s in subtrees]

        return read

    def _stored_or_computed(
        self, conn: sa.Connection, strict: merkle.HashReader, s: merkle.Subtree
    ) -> bytes:
        try:
            (h,) = strict([s])
        except VerificationError:
            lo, hi = s.position << s.level, (s.position + 1) << s.level
            h = merkle.tree_levels(self.leaf_hashes(conn, lo, hi))[s.level][0]
            _log.warning(
                "ledger subtree hash missing; computed from the leaf hashes",
                first_entry=lo,
                last_entry=hi - 1,
            )
        return h

    def root(self, size: int, conn: sa.Connection) -> bytes:
        return merkle.root_from_subtrees(size, self.complete_reader(conn))

    def checkpoints(self, conn: sa.Connection) -> list[CheckpointRow]:
        c = t.checkpoints.c
        rows = conn.execute(sa.select(c.size, c.root, c.note, c.prev_size).order_by(c.size))
        return [CheckpointRow(int(s), bytes(r), str(n), p) for s, r, n, p in rows]

    def checkpoints_newest_first(self, conn: sa.Connection) -> Iterator[CheckpointRow]:
        """Stored checkpoint rows from the largest size down, a page at a time (the caller
        usually stops at the first; no cursor is left open on the connection)."""
        c = t.checkpoints.c
        below: int | None = None
        while True:
            stmt = sa.select(c.size, c.root, c.note, c.prev_size).order_by(c.size.desc())
            if below is not None:
                stmt = stmt.where(c.size < below)
            rows = conn.execute(stmt.limit(_CHECKPOINT_PAGE)).all()
            for s, r, n, p in rows:
                yield CheckpointRow(int(s), bytes(r), str(n), p)
            if len(rows) < _CHECKPOINT_PAGE:
                return
            below = int(rows[-1][0])

    def latest_checkpoint(self, conn: sa.Connection) -> CheckpointRow | None:
        """The checkpoint the head row names as latest (VerificationError if it is gone)."""
        size = conn.execute(
            sa.select(t.head.c.checkpoint_size).where(t.head.c.id == 1)
        ).scalar_one_or_none()
        if size is None:
            return None
        c = t.checkpoints.c
        row = conn.execute(
            sa.select(c.size, c.root, c.note, c.prev_size).where(c.size == size)
        ).first()
        if row is None:
            raise VerificationError(f"the latest checkpoint (size {size}) is missing")
        return CheckpointRow(int(row[0]), bytes(row[1]), str(row[2]), row[3])

    # -- writes --------------------------------------------------------------------------------

    def lock_head(self, conn: sa.Connection) -> int:
        """Lock the head row for the rest of the transaction and return the tree size."""
        stmt = sa.select(t.head.c.size).where(t.head.c.id == 1).with_for_update()
        return _head_size(conn.execute(stmt).scalar_one_or_none())

    def _load_frontier(self, conn: sa.Connection, size: int) -> merkle.Frontier:
        """The right edge of the tree of `size` from O(log n) stored hashes. A subtree hash that is
        missing (entries appended by something other than this code, which stores none) is rebuilt
        from the leaf hashes and stored, so that such an append cannot stop every later one."""
        subtrees = merkle.range_subtrees(0, size) if size else []
        read = self.reader(conn)
        try:  # the usual case: one batched read (this runs whenever another process appended)
            hashes = list(read(subtrees)) if subtrees else []
        except VerificationError:  # rare: find and rebuild what is missing, one subtree at a time
            hashes = []
            for s in subtrees:
                try:
                    (h,) = read([s])
                except VerificationError:
                    h = self._rebuild_subtree(conn, s)
                hashes.append(h)
        return merkle.Frontier(size, list(zip(subtrees, hashes, strict=True)))

    def _rebuild_subtree(self, conn: sa.Connection, s: merkle.Subtree) -> bytes:
        lo, hi = s.position << s.level, (s.position + 1) << s.level
        e = t.entries.c
        rows = conn.execute(
            sa.select(e.leaf_hash).where(e.idx >= lo, e.idx < hi).order_by(e.idx)
        ).scalars()
        levels = merkle.tree_levels(bytes(h) for h in rows)
        if len(levels[0]) != hi - lo:
            raise VerificationError(f"entries {lo}..{hi - 1} are incomplete: the log was altered")
        for level in range(1, s.level + 1):  # every complete subtree inside it, level 0 excluded
            base = lo >> level
            params = [
                {"id": t.hash_key(level, base + i), "hash": h} for i, h in enumerate(levels[level])
            ]
            have = set(
                conn.execute(
                    sa.select(t.hashes.c.id).where(t.hashes.c.id.in_([p["id"] for p in params]))
                ).scalars()
            )
            missing = [p for p in params if p["id"] not in have]
            if missing:
                conn.execute(sa.insert(t.hashes), missing)
        _log.warning(
            "ledger subtree hashes were missing and were rebuilt from the leaf hashes",
            first_entry=lo,
            last_entry=hi - 1,
        )
        return levels[s.level][0]

    def append(self, prepared: Sequence[PreparedEntry], after: AfterAppend | None = None) -> int:
        """Append `prepared` entries durably; return the index of the first. `after(conn, first)`
        runs inside the same transaction (used to make erasures atomic with their record)."""
        return self.append_collected(lambda _conn: prepared, after)[0]

    def append_collected(
        self, collect: Collect | Claim, after: AfterAppend | None = None
    ) -> tuple[int, int]:
        """`append` of the entries `collect(conn)` reads inside the transaction, once the head lock
        is held: no other append, in this process or another, runs until this one commits, so what
        it reads cannot be appended meanwhile (the outbox drains read their pending rows so).
        A `Claim` (its own `after`) is sent in two round trips on PostgreSQL (`_append_claimed`).
        Returns the index of the first entry and how many; none appends nothing."""
        if not callable(collect):  # a Claim
            claim = collect
            if self.engine.dialect.name == "postgresql":
                return self._append_claimed(claim)
            collect, after = claim.collect, claim.after
        with self._lock:
            with write_transaction(self.engine) as conn:
                first = self.lock_head(conn)
                prepared = collect(conn)
                frontier = None
                if prepared:
                    frontier = self._frontier_at(conn, first)
                    self._insert(conn, first, prepared, frontier)  # its triggers move the head
                if after is not None:
                    after(conn, first)
            if frontier is not None:
                self._frontier = frontier  # only once the transaction has committed
        return first, len(prepared)

    def _append_claimed(self, claim: Claim) -> tuple[int, int]:
        """PostgreSQL: the append protocol in two pipelines. The first sends BEGIN, the head lock,
        the frontier of the locked size (rows only when another process appended since this one's
        last append) and the claim's query; each statement after the lock reads a snapshot taken
        once the lock was granted. The second sends the inserts, the claim's mark and COMMIT: a mark
        that fails aborts the pipeline, so the COMMIT never runs and the transaction rolls back."""
        import psycopg  # noqa: PLC0415 (only with PostgreSQL, an optional extra)

        with self._lock:
            with write_transaction(self.engine) as conn:
                try:
                    first, prepared, frontier = self._claim_pipelines(conn, claim)
                except psycopg.errors.DivisionByZero:
                    raise claim.refused() from None
                except psycopg.Error as exc:
                    # As SQLAlchemy would raise it (a lock timeout is an OperationalError: the
                    # callers defer delivery and the API answers 503), parameters hidden.
                    raise sa.exc.DBAPIError.instance(
                        "ledger append (pipelined)",
                        None,
                        exc,
                        psycopg.Error,
                        hide_parameters=True,
                        dialect=self.engine.dialect,
                    ) from exc
            if frontier is not None:
                self._frontier = frontier  # committed
        return first, len(prepared)

    def _claim_pipelines(
        self, conn: sa.Connection, claim: Claim
    ) -> tuple[int, Sequence[PreparedEntry], merkle.Frontier | None]:
        """`_append_claimed`'s two round trips on `conn`'s driver connection; returns the first
        index, the entries and the new frontier (None: nothing appended, nothing to mark)."""
        raw = conn.connection.driver_connection
        assert raw is not None
        known = self._frontier.size
        query, params = claim.select()
        with raw.cursor() as head, raw.cursor() as edge, raw.cursor() as found:
            with raw.pipeline():
                head.execute(_PG_LOCK_SQL)  # psycopg sends BEGIN before it
                edge.execute(_PG_FRONTIER_SQL, (known,))
                found.execute(query, params)
            # The pipeline has ended: every result is in.
            first = _head_size(_only(head.fetchall()))
            prepared = claim.take(found.fetchall())
            edge_rows = edge.fetchall()
        if not prepared:
            return first, prepared, None  # the transaction commits empty
        frontier = self._frontier_at(conn, first, edge_rows)
        tables = _insert_params(first, prepared, frontier)
        piped = len(prepared) <= _PG_PIPELINED_MAX_ENTRIES
        if not piped:
            for table, rows in tables:
                _insert_flat(conn, table, rows)
        mark, mark_params = claim.mark(first)
        with raw.pipeline(), raw.cursor() as cursor:
            if piped:
                _execute_inserts(cursor, tables)
            cursor.execute(mark, mark_params)
            cursor.execute("COMMIT")
        return first, prepared, frontier

    def _frontier_at(
        self, conn: sa.Connection, size: int, stored: Rows | None = None
    ) -> merkle.Frontier:
        """A copy of the frontier of `size`: this process's own when it made the last append,
        else the `stored` rows of `_PG_FRONTIER_SQL` if none is missing, else read (and any
        missing hash rebuilt) by `_load_frontier`."""
        if self._frontier.size == size:
            return self._frontier.copy()
        nodes = []
        for level, value in stored or ():
            if value is None:
                return self._load_frontier(conn, size)
            k = int(level)  # type: ignore[call-overload]
            nodes.append((merkle.Subtree(k, (size >> k) - 1), blob(value, f"stored hash {k}")))
        if stored is None:  # another process appended since our last append
            return self._load_frontier(conn, size)
        return merkle.Frontier(size, nodes)

    def _insert(
        self,
        conn: sa.Connection,
        first: int,
        prepared: Sequence[PreparedEntry],
        frontier: merkle.Frontier,
    ) -> None:
        tables = _insert_params(first, prepared, frontier)
        if conn.dialect.name == "postgresql" and len(prepared) <= _PG_PIPELINED_MAX_ENTRIES:
            _insert_pipelined(conn, tables)
            return
        for table, params in tables:
            _insert_flat(conn, table, params)

    def insert_checkpoint(
        self, conn: sa.Connection, size: int, root: bytes, note: str, prev_size: int | None
    ) -> None:
        """Store a checkpoint, chained to the previous one; a trigger names it in the head row."""
        conn.execute(
            sa.insert(t.checkpoints).values(size=size, root=root, note=note, prev_size=prev_size)
        )


def _only(rows: Rows) -> int | None:
    """The single value of a one-row, one-column result (None: no row)."""
    if not rows:
        return None
    (value,) = rows[0]
    return None if value is None else int(value)  # type: ignore[call-overload]


def _insert_params(
    first: int, prepared: Sequence[PreparedEntry], frontier: merkle.Frontier
) -> tuple[tuple[sa.Table, list[object]], ...]:
    """The rows of `prepared` at `first` as flat parameter lists, one per table in insert order
    (no per-row tuples: `_insert_flat` cuts them into multi-row statements); `frontier` takes
    the new leaves."""
    entry_params: list[object] = []
    block_params: list[object] = []
    command_params: list[object] = []
    payload_params: list[object] = []
    hash_params: list[object] = []
    add_entry, add_blocks, add_node = entry_params.extend, block_params.extend, frontier.append
    for i, p in enumerate(prepared, start=first):
        add_entry((i, p.leaf, p.leaf_hash, p.kind, p.scope_tag, p.request_id, p.ts_us))
        for b in dict.fromkeys(p.block_ids):
            add_blocks((b, i))
        for c in p.command_ids:  # empty for all but purge and purge-request entries
            command_params.extend((c, i))
        if p.payload is not None:
            payload_params.extend((i, p.payload[0], p.payload[1]))
        for key, h in add_node(p.leaf_hash):  # level 0 is the entry row's leaf_hash
            hash_params.extend((key, h))
    return (
        (t.entries, entry_params),
        (t.entry_blocks, block_params),
        (t.entry_commands, command_params),
        (t.payloads, payload_params),
        (t.hashes, hash_params),
    )


def _insert_flat(conn: sa.Connection, table: sa.Table, params: list[object]) -> None:
    """Bulk insert rows given as one flat list of column values in table order.

    PostgreSQL: COPY in the same transaction, several times faster than a pipelined executemany
    (docs/benchmarks.md). SQLite: multi-row `INSERT ... VALUES (...), (...)` statements on the raw
    driver cursor, within SQLite's historical limit of 999 parameters per statement: one statement
    step per ~140-500 rows instead of one per row. Measured on the 2-core benchmark VM: 4.4 us per
    row with `executemany`, 2.3-2.7 us with 100-500 rows per statement (docs/benchmarks.md).
    SQLAlchemy's own per-row parameter processing cost more than SQLite itself (profiled: 0.33 s of
    0.6 s per 10,000 entries), and these columns need no type conversion.
    """
    if not params:
        return
    width = len(table.columns)
    names = ", ".join(c.name for c in table.columns)
    if conn.dialect.name == "postgresql":
        raw = conn.connection.driver_connection
        assert raw is not None
        with raw.cursor() as cur, cur.copy(f"COPY {table.name} ({names}) FROM STDIN") as copy:
            for row in zip(*[iter(params)] * width, strict=True):
                copy.write_row(row)
        return
    per_statement = width * (_SQLITE_MAX_PARAMS // width)
    verb = "INSERT OR IGNORE" if table.name in _IGNORED_ON_SQLITE else "INSERT"
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        for start in range(0, len(params), per_statement):
            chunk = params[start : start + per_statement]
            cursor.execute(_values_sql(verb, table.name, names, width, len(chunk) // width), chunk)
    finally:
        cursor.close()


def _insert_pipelined(conn: sa.Connection, tables: Sequence[tuple[sa.Table, list[object]]]) -> None:
    """PostgreSQL, a few entries: one multi-row `INSERT` per table, sent as one psycopg pipeline
    (one round trip for every table), in table order, so each table's trigger sees the rows of the
    tables before it. A COPY costs two round trips per table (start, finish), and an append holds
    the ledger's head lock across them: the admin API's outbox drains append a handful of entries
    each, and with two server processes each drain waited for the other's round trips
    (docs/benchmarks.md, "Control plane under load", 2026-11-27, tenth session)."""
    raw = conn.connection.driver_connection
    assert raw is not None
    with raw.pipeline(), raw.cursor() as cursor:
        _execute_inserts(cursor, tables)


def _execute_inserts(cursor: Any, tables: Sequence[tuple[sa.Table, list[object]]]) -> None:
    """One multi-row `INSERT` per table that has rows, on a PostgreSQL cursor (in a pipeline)."""
    for table, params in tables:
        if params:
            width = len(table.columns)
            names = ", ".join(c.name for c in table.columns)
            sql = _values_sql("INSERT", table.name, names, width, len(params) // width, mark="%s")
            cursor.execute(sql, params)


@lru_cache(maxsize=256)
def _values_sql(
    verb: str, table: str, names: str, width: int, rows: int, *, mark: str = "?"
) -> str:
    row = "(" + ", ".join([mark] * width) + ")"
    return f"{verb} INTO {table} ({names}) VALUES {', '.join([row] * rows)}"


def _select_in(conn: sa.Connection, select: str, key: str, keys: Sequence[int]) -> dict[int, bytes]:
    """`select ... WHERE key IN (...)` as plain driver SQL: the proof path is a handful of indexed
    point reads, and SQLAlchemy's statement compilation cost more than the reads (profiled)."""
    found: dict[int, bytes] = {}
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    for i in range(0, len(keys), _IN_CHUNK):
        chunk = tuple(keys[i : i + _IN_CHUNK])
        sql = f"{select} WHERE {key} IN ({', '.join(mark for _ in chunk)})"
        found.update(
            (int(k), blob(v, f"stored hash {k}")) for k, v in conn.exec_driver_sql(sql, chunk)
        )
    return found


def _head_size(value: int | None) -> int:
    if value is None:  # the migration creates it and triggers forbid deleting it
        raise VerificationError("the ledger head row is missing: the log was tampered with")
    return int(value)
