"""Admin API audit benchmarks (issue 6, item 6). Results go to docs/benchmarks.md.

    .venv/bin/python benchmarks/api_bench.py [--entries 1000000] [--requests 200] [--dir DIR]

1. Builds (or reuses, in `--dir`) a SQLite ledger of `--entries` entries (`benchmarks/api_ledger.py`:
   durable `append_many` batches, as `audit_bench.py` builds its own).
2. Starts `kvguard serve` on it in a child process (one uvicorn worker, checkpoints on demand).
3. From this process, one HTTP/1.1 keep-alive client (httpx) sends `--requests` requests of each
   query shape, in a shuffled order, after a warm-up (one request per API key, since a key's first
   use costs an scrypt check, and one per shape), and reports client-side latency p50 / p99 per
   shape and over the whole mix (target: p99 < 50 ms), and the five slowest requests.
4. Streams a complete export and a one-tenant export, parsing the tar as it arrives and counting
   entries.jsonl lines, and reports entries/s (target >= 50,000) and the server's resident memory
   before and at its peak during each export (sampled every 0.1 s).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import api_ledger  # benchmarks/ is on sys.path when this script runs
import httpx

Shape = Callable[[random.Random], tuple[str, str, dict[str, Any]]]  # -> (key, path, params)


def _iso(seconds: float) -> str:
    return (api_ledger.T0 + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def shapes(n: int) -> dict[str, Shape]:
    """Query shapes: who asks, which path, which parameters (random but seeded)."""
    span = n / 1000  # seconds of log: one entry per millisecond
    dense = api_ledger.TENANTS[:-1]

    def deep(r: random.Random) -> int:
        return r.randrange(int(n * 0.9), n - 200)

    return {
        "kind (common), cursor anywhere": lambda r: (
            "auditor", "/v1/audit/entries", {"kind": "block.zeroize", "cursor": r.randrange(n)}
        ),
        "kind (rare: admin.action), deep cursor": lambda r: (
            "auditor", "/v1/audit/entries", {"kind": "admin.action", "cursor": deep(r)}
        ),
        "kind (rarest: policy.change)": lambda r: (
            "auditor", "/v1/audit/entries", {"kind": "policy.change"}
        ),
        "tenant filter (auditor), cursor anywhere": lambda r: (
            "auditor", "/v1/audit/entries",
            {"tenant_id": r.choice(dense), "cursor": r.randrange(n)},
        ),
        "tenant_admin, own entries, deep cursor": lambda r: (
            r.choice(dense), "/v1/audit/entries", {"cursor": deep(r)}
        ),
        "sparse tenant (1 in 5,000)": lambda r: (
            "auditor", "/v1/audit/entries", {"tenant_id": api_ledger.SPARSE}
        ),
        "time range, 10 s window": lambda r: _window(r, span, 10),
        "time range, since only (open end)": lambda r: (
            "auditor", "/v1/audit/entries", {"since": _iso(r.uniform(0, span))}
        ),
        "time range, 80% of the log": lambda r: _window(r, span * 0.1, span * 0.8),
        "request_id": lambda r: (
            "auditor", "/v1/audit/entries", {"request_id": f"req-{r.randrange(n // 6)}"}
        ),
        "block_id": lambda r: (
            "auditor", "/v1/audit/entries", {"block_id": r.randrange(65_536)}
        ),
        "no filter, deep cursor": lambda r: (
            "auditor", "/v1/audit/entries", {"cursor": deep(r)}
        ),
        "tenant + kind + 60 s window": lambda r: (
            "auditor", "/v1/audit/entries",
            {"tenant_id": r.choice(dense), "kind": "block.release",
             **_window(r, span, 60)[2]},
        ),
        "entry + inclusion proof": lambda r: (
            "auditor", f"/v1/audit/entries/{r.randrange(n)}", {}
        ),
    }  # fmt: skip


def _window(r: random.Random, span: float, width: float) -> tuple[str, str, dict[str, Any]]:
    start = r.uniform(0, max(0.0, span - width))
    return "auditor", "/v1/audit/entries", {"since": _iso(start), "until": _iso(start + width)}


def start_server(built: api_ledger.BenchLedger, port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KVGUARD_SIGNING_KEY_FILE": str(built.signing_key_file),
        "KVGUARD_SALT_KEYRING_FILE": str(built.keyring_file),
        "KVGUARD_LOG_LEVEL": "WARNING",
    }
    kvguard = Path(sys.executable).with_name("kvguard")
    cmd = [str(kvguard), "serve", "--db", built.url, "--port", str(port)]
    cmd += ["--origin", api_ledger.ORIGIN, "--checkpoint-interval", "0"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code < 500:
                return server
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(
        f"the server did not start: {server.stderr.read().decode() if server.stderr else ''}"
    )


def run_mix(
    client: httpx.Client, keys: dict[str, str], mix: dict[str, Shape], requests: int
) -> tuple[dict[str, list[float]], list[tuple[float, str, dict[str, Any]]]]:
    """Latencies per shape, and the slowest requests (ms, path, parameters)."""
    rng = random.Random(11)
    plan = [name for name in mix for _ in range(requests)]
    for who in keys:  # a key's first use costs one scrypt check (~50-100 ms here, by design)
        _timed(client, keys, who, "/v1/audit/checkpoints/latest", {})
    for shape in mix.values():  # warm-up: connections, caches, the time marks
        _timed(client, keys, *shape(rng))
    rng.shuffle(plan)
    samples: dict[str, list[float]] = {name: [] for name in mix}
    slowest: list[tuple[float, str, dict[str, Any]]] = []
    for name in plan:
        who, path, params = mix[name](rng)
        ms = _timed(client, keys, who, path, params)
        samples[name].append(ms)
        slowest = sorted([*slowest, (ms, path, params)], key=lambda x: -x[0])[:5]
    return samples, slowest


def _timed(
    client: httpx.Client, keys: dict[str, str], who: str, path: str, params: dict[str, Any]
) -> float:
    headers = {"Authorization": f"Bearer {keys[who]}"}
    start = time.perf_counter()
    r = client.get(path, params=params, headers=headers)
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise SystemExit(f"{path} {params}: {r.status_code} {r.text[:300]}")
    return elapsed * 1000


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


class _Raw:
    """A file object over a streamed HTTP body, for `tarfile`'s stream mode."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._buf = chunks, b""
        self.received = 0

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buf) < size:
            piece = next(self._chunks, b"")
            if not piece:
                break
            self.received += len(piece)
            self._buf += piece
        out, self._buf = (self._buf, b"") if size < 0 else (self._buf[:size], self._buf[size:])
        return out


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def export(client: httpx.Client, key: str, params: dict[str, Any], pid: int) -> dict[str, float]:
    """Stream one export, count entries.jsonl lines as they arrive, sample the server's RSS."""
    before, peak, done = _rss_mb(pid), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb(pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = 0
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("GET", "/v1/audit/export", params=params, headers=headers, timeout=600) as r:
        raw = _Raw(r.iter_raw(1 << 20))
        with tarfile.open(fileobj=raw, mode="r|*") as tar:  # type: ignore[call-overload]
            for member in tar:
                if member.name.endswith("/entries.jsonl"):
                    f = tar.extractfile(member)
                    while block := f.read(1 << 20):
                        lines += block.count(b"\n")
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    return {
        "entries": lines,
        "seconds": elapsed,
        "entries_per_s": lines / elapsed,
        "mb": raw.received / 1e6,
        "rss_before_mb": before,
        "rss_peak_mb": peak[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200, help="requests per query shape")
    parser.add_argument("--dir", type=Path, default=None, help="ledger directory (reused)")
    parser.add_argument("--port", type=int, default=8617)
    args = parser.parse_args()
    directory = args.dir or Path(f"/tmp/kvg-api-bench-{args.entries}")
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()} cpus={os.cpu_count()} "
        f"python={platform.python_version()} sqlite={sqlite3.sqlite_version} "
        f"{datetime.now(UTC):%Y-%m-%d}"
    )
    built = api_ledger.build(directory, args.entries)
    server = start_server(built, args.port)
    try:
        print(f"load average at start: {os.getloadavg()}")
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=60) as client:
            samples, slowest = run_mix(client, built.keys, shapes(args.entries), args.requests)
            every = [v for values in samples.values() for v in values]
            print(f"{'shape':42s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}")
            for name, values in samples.items():
                print(
                    f"{name:42s} {pct(values, 0.5):8.2f} {pct(values, 0.99):8.2f} {max(values):8.2f}"
                )
            print(
                f"{'all ' + str(len(every)) + ' requests':42s} {pct(every, 0.5):8.2f} "
                f"{pct(every, 0.99):8.2f} {max(every):8.2f} (mean {statistics.fmean(every):.2f})"
            )
            for ms, path, params in slowest:
                print(f"slow: {ms:.1f} ms {path} {params}")
            for label, key, params in (
                ("complete export", built.keys["admin"], {}),
                ("one tenant's export (t03)", built.keys["auditor"], {"tenant_id": "t03"}),
                ("complete export, tar.gz", built.keys["admin"], {"format": "tar.gz"}),
            ):
                result = export(client, key, params, server.pid)
                print(f"{label}: " + ", ".join(f"{k}={v:,.1f}" for k, v in result.items()))
        print(f"load average at end: {os.getloadavg()}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
