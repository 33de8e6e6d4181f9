"""Audit ledger benchmarks (issue 3, item 11). Results go to docs/benchmarks.md.

    .venv/bin/python benchmarks/audit_bench.py [--proof-entries 1000000] [--pg URL]
        [--only append append-ratio append-pg submit proofs verify] [--rounds 3]

Measures, each with the durability setting it used:
1. durable `append_many` throughput on SQLite (WAL, synchronous=FULL) and PostgreSQL
   (synchronous_commit=on, COPY in one transaction per batch);
1b. the same appends against raw durable inserts of the same rows (`append-ratio`, issue 12 item 8);
2. `submit` latency (the engine hot path) and the group-committed throughput behind it;
3. inclusion and consistency proof time at `--proof-entries` entries (default 1M), with the number of
   stored hashes each proof reads, and that read count computed for 10M (extrapolation: reads, not
   time);
4. `verify --full` (offline) speed on a complete export, with and without the SIEM renderings, in two
   processes (the default) and in one; CPU rates count the forked child too.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from kvguard.audit import merkle, schema
from kvguard.audit.events import AuditEvent
from kvguard.audit.leaf import prepare_entry
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey

T0 = datetime(2026, 11, 26, tzinfo=UTC)
ORIGIN = "bench.kvguard/audit"


def events(n: int, start: int = 0) -> list[AuditEvent]:
    kinds = ["block.alloc", "block.reuse", "block.release", "block.zeroize"]
    return [
        AuditEvent(
            kind=kinds[i % 4],
            scope_tag=f"st-{i % 16:04x}",
            request_id=f"req-{i // 4}",
            block_ids=[i % 4096, (i + 1) % 4096],
            details={"blocks": 2, "layer_bytes": 65536},
            ts=T0 + timedelta(microseconds=i),
        )
        for i in range(start, start + n)
    ]


def append_rate(ledger: Ledger, total: int, batch: int) -> float:
    return append_rates(ledger, total, batch)[0]


def append_rates(ledger: Ledger, total: int, batch: int) -> tuple[float, float]:
    """(wall-clock events/s, events per second of this process's CPU time). The second shows the
    cost on an idle core: the shared benchmark machine runs other engineers' jobs meanwhile."""
    pool = events(batch)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(total // batch):
        ledger.append_many(pool)
    return total / (time.perf_counter() - start), total / (time.process_time() - cpu)


def bench_append(url: str, total: int, batch: int, key: SigningKey) -> tuple[float, float]:
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
    try:
        append_rates(ledger, batch, batch)  # warm-up: schema, caches
        return append_rates(ledger, total, batch)
    finally:
        ledger.close()


def raw_rows(batch: int) -> dict[str, list[tuple[object, ...]]]:
    """The rows one `append_many(events(batch))` at index 0 writes, per table, precomputed."""
    frontier = merkle.Frontier(0, [])
    rows: dict[str, list[tuple[object, ...]]] = {
        "ledger_entries": [],
        "ledger_entry_blocks": [],
        "ledger_hashes": [],
    }
    for i, p in enumerate(prepare_entry(e) for e in events(batch)):
        rows["ledger_entries"].append(
            (i, p.leaf, p.leaf_hash, p.kind, p.scope_tag, p.request_id, p.ts_us)
        )
        rows["ledger_entry_blocks"] += [(b, i) for b in dict.fromkeys(p.block_ids)]
        rows["ledger_hashes"] += frontier.append(p.leaf_hash)
    return rows


def raw_insert_rate(path: Path, total: int, batch: int, *, multi_row: bool = False) -> float:
    """Events/s of plain durable inserts of the ledger's rows (same tables and indexes, no
    triggers, WAL + synchronous=FULL, one transaction per batch): `executemany`, or with
    `multi_row` `INSERT ... VALUES (...), (...)` statements of up to 999 parameters (the faster
    way, which the ledger itself uses). Later batches shift the indices (keys stay unique)."""
    engine = sa.create_engine(f"sqlite:///{path}")
    schema.metadata.create_all(engine)
    engine.dispose()
    rows = raw_rows(batch)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA cache_size=-65536")
    start = time.perf_counter()
    for round_ in range(total // batch):
        shift = round_ * batch
        conn.execute("BEGIN")
        for table, shifted in (
            ("ledger_entries", [(r[0] + shift, *r[1:]) for r in rows["ledger_entries"]]),  # type: ignore[operator]
            ("ledger_entry_blocks", [(b, i + shift) for b, i in rows["ledger_entry_blocks"]]),  # type: ignore[operator]
            # hash keys differ by batch too: offset the index part
            ("ledger_hashes", [(k + round_ * (1 << 40), h) for k, h in rows["ledger_hashes"]]),  # type: ignore[operator]
        ):
            _raw_insert(conn, table, shifted, multi_row)
        conn.execute("COMMIT")
    rate = total / (time.perf_counter() - start)
    conn.close()
    return rate


def _raw_insert(
    conn: sqlite3.Connection, table: str, rows: list[tuple[object, ...]], multi_row: bool
) -> None:
    width = len(rows[0])
    one = "(" + ", ".join("?" * width) + ")"
    if not multi_row:
        conn.executemany(f"INSERT INTO {table} VALUES {one}", rows)
        return
    per = 999 // width
    for at in range(0, len(rows), per):
        chunk = rows[at : at + per]
        flat = [v for row in chunk for v in row]
        conn.execute(f"INSERT INTO {table} VALUES {', '.join([one] * len(chunk))}", flat)


def bench_append_ratio(
    work: Path, total: int, batch: int, key: SigningKey, rounds: int
) -> dict[str, float]:
    """Ledger appends against raw inserts of the same rows, alternating, fresh files each round;
    medians and the ratio of medians (issue 12, item 8: >= 0.30)."""
    ledger_rates, many_rates, raw_rates = [], [], []
    for r in range(rounds):
        ledger_rates.append(bench_append(f"sqlite:///{work / f'r{r}.db'}", total, batch, key)[0])
        many_rates.append(raw_insert_rate(work / f"many{r}.db", total, batch))
        multi = raw_insert_rate(work / f"raw{r}.db", total, batch, multi_row=True)
        raw_rates.append(max(multi, many_rates[-1]))  # the faster raw way of this round
    ledger_rate, raw_rate = statistics.median(ledger_rates), statistics.median(raw_rates)
    return {
        "ledger_events_per_s": ledger_rate,
        "raw_executemany_events_per_s": statistics.median(many_rates),
        "raw_fastest_events_per_s": raw_rate,
        "ratio": ledger_rate / raw_rate,
        "ratio_min": min(a / b for a, b in zip(ledger_rates, raw_rates, strict=True)),
        "ratio_max": max(a / b for a, b in zip(ledger_rates, raw_rates, strict=True)),
    }


def bench_submit(url: str, total: int, key: SigningKey) -> dict[str, float]:
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key, queue_capacity=total + 1)
    pool = events(1_000)
    lat = []
    try:
        start = time.perf_counter()
        for i in range(total):
            t = time.perf_counter_ns()
            ledger.submit(pool[i % 1_000])
            lat.append(time.perf_counter_ns() - t)
        submitted = time.perf_counter() - start
        ledger.flush(timeout=600)
        durable = time.perf_counter() - start
    finally:
        ledger.close()
    lat.sort()
    return {
        "median_us": lat[len(lat) // 2] / 1000,
        "p99_us": lat[int(len(lat) * 0.99)] / 1000,
        "mean_us": statistics.fmean(lat) / 1000,
        "submit_s": submitted,
        "durable_rate": total / durable,
    }


def timed(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def reads(ranges: list[tuple[int, int]]) -> int:
    return len({s for lo, hi in ranges for s in merkle.range_subtrees(lo, hi)})


def bench_proofs(url: str, n: int, key: SigningKey) -> dict[str, float]:
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
    try:
        if ledger.size < n:
            append_rate(ledger, n - ledger.size, 10_000)
        rng = random.Random(1)
        size = ledger.size
        inc = timed(lambda: ledger.inclusion_proof(rng.randrange(size), size), 1_000)
        old = [rng.randrange(1, size) for _ in range(1_000)]
        it = iter(old)
        con = timed(lambda: ledger.consistency_proof(next(it), size), 1_000)
    finally:
        ledger.close()
    big = 10_000_000
    return {
        "size": size,
        "inclusion_median_us": inc[0],
        "inclusion_p99_us": inc[1],
        "consistency_median_us": con[0],
        "consistency_p99_us": con[1],
        "inclusion_reads": max(
            reads(merkle.inclusion_ranges(i, size)) for i in (0, size // 3, size - 1)
        ),
        "consistency_reads": max(reads(merkle.consistency_ranges(o, size)) for o in old[:50]),
        "inclusion_reads_10m": max(
            reads(merkle.inclusion_ranges(i, big)) for i in (0, big // 3, big - 1)
        ),
        "consistency_reads_10m": max(
            reads(merkle.consistency_ranges(o, big)) for o in (1, 777_777, big // 3, big - 1)
        ),
    }


def bench_verify(url: str, n: int, key: SigningKey, work: Path) -> dict[str, float]:
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
    out: dict[str, float] = {}
    try:
        append_rate(ledger, n, 10_000)
        for renderings in (False, True):
            target = work / f"bundle-{renderings}"
            t = time.perf_counter()
            ledger.export(target, renderings=renderings)
            out[f"export_rate_{renderings}"] = n / (time.perf_counter() - t)
            for parallel in (True, False):  # two processes (the default) and one
                t, cpu = time.perf_counter(), _cpu_seconds()
                verify_bundle(target, [key.verifier_key()], full=True, parallel=parallel)
                tag = f"{renderings}{'' if parallel else '_one_process'}"
                out[f"verify_full_rate_{tag}"] = n / (time.perf_counter() - t)
                out[f"verify_full_cpu_rate_{tag}"] = n / (_cpu_seconds() - cpu)
            out[f"bundle_mb_{renderings}"] = sum(p.stat().st_size for p in target.iterdir()) / 1e6
            shutil.rmtree(target)
    finally:
        ledger.close()
    return out


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (`verify --full` forks one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def pg_database(base: str) -> tuple[str, Callable[[], None]]:
    name = f"kvg_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    return sa.engine.make_url(base).set(database=name).render_as_string(False), drop


def _run_append(args: argparse.Namespace, key: SigningKey, work: Path) -> None:
    rate, cpu = bench_append(f"sqlite:///{work / 'a.db'}", args.append_entries, args.batch, key)
    print(
        f"append_many sqlite (WAL, synchronous=FULL), batch {args.batch}: {rate:,.0f} events/s"
        f" (per CPU-second of this process: {cpu:,.0f})"
    )


def _run_append_ratio(args: argparse.Namespace, key: SigningKey, work: Path) -> None:
    out = bench_append_ratio(work, args.append_entries, args.batch, key, args.rounds)
    print(
        f"append vs raw inserts (sqlite, batch {args.batch}, {args.rounds} alternating rounds): "
        + ", ".join(f"{k}={v:,.3f}" for k, v in out.items())
    )


def _run_append_pg(args: argparse.Namespace, key: SigningKey, _work: Path) -> None:
    pg_url, drop = pg_database(args.pg)
    try:
        rate, cpu = bench_append(pg_url, args.append_entries, args.batch, key)
        print(
            f"append_many postgresql (synchronous_commit=on), batch {args.batch}: "
            f"{rate:,.0f} events/s (client CPU only: {cpu:,.0f})"
        )
    finally:
        drop()


def _run_submit(args: argparse.Namespace, key: SigningKey, work: Path) -> None:
    sub = bench_submit(f"sqlite:///{work / 's.db'}", args.submit_entries, key)
    print("submit (sqlite behind it): " + ", ".join(f"{k}={v:,.2f}" for k, v in sub.items()))


def _run_proofs(args: argparse.Namespace, key: SigningKey, work: Path) -> None:
    proofs = bench_proofs(f"sqlite:///{work / 'p.db'}", args.proof_entries, key)
    print("proofs (sqlite): " + ", ".join(f"{k}={v:,.1f}" for k, v in proofs.items()))


def _run_verify(args: argparse.Namespace, key: SigningKey, work: Path) -> None:
    ver = bench_verify(f"sqlite:///{work / 'v.db'}", args.verify_entries, key, work)
    print("export/verify --full: " + ", ".join(f"{k}={v:,.1f}" for k, v in ver.items()))


_PARTS: dict[str, Callable[[argparse.Namespace, SigningKey, Path], None]] = {
    "append": _run_append,
    "append-ratio": _run_append_ratio,
    "append-pg": _run_append_pg,
    "submit": _run_submit,
    "proofs": _run_proofs,
    "verify": _run_verify,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append-entries", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (append-ratio)")
    parser.add_argument("--submit-entries", type=int, default=100_000)
    parser.add_argument("--proof-entries", type=int, default=1_000_000)
    parser.add_argument("--verify-entries", type=int, default=200_000)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=_PARTS,
        default=list(_PARTS),
        help="run only these measurements (default: all)",
    )
    parser.add_argument(
        "--pg",
        default=os.environ.get(
            "KVGUARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    args = parser.parse_args()
    key = SigningKey.generate("bench.kvguard")
    work = Path(tempfile.mkdtemp(prefix="kvg-audit-bench-"))
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()} "
        f"cpus={os.cpu_count()} python={platform.python_version()} {datetime.now(UTC):%Y-%m-%d}"
    )
    try:
        print(f"load average at start: {os.getloadavg()}")
        for part in args.only:
            _PARTS[part](args, key, work)
        print(f"load average at end: {os.getloadavg()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
