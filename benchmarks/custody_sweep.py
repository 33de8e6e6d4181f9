"""What one expiry sweep and one heartbeat's pool summary cost the scheduler thread as the cache grows
(GPU engines cache ~10^5 blocks, sweep up to four times a second and report every two seconds).

A custody of N blocks, all cached by 64 tenants (default retention: 1 h TTL, 10 min idle), then:
the pool summary a heartbeat reports, a sweep when nothing has expired, a sweep after a policy change that shortens one tenant's TTL (its
blocks are rescheduled and expire), and a sweep when every block has expired. Pure Python, no engine.

Run: .venv/bin/python benchmarks/custody_sweep.py [--blocks 1000 10000 100000]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from kvguard.engine_adapter.custody import Custody
from kvguard.isolation import Keyring
from kvguard.isolation.salts import SaltDeriver
from kvguard.isolation.scope import CacheConfig, ModelRef, Scope, TokenizerRef
from kvguard.policy import PolicySet, Retention, TenantPolicy

TENANTS = 64
PER_REQUEST = 16
DERIVER = SaltDeriver(Keyring({"k1": bytes(range(32))}, active="k1"))


def scope(tenant: str) -> Scope:
    return Scope(
        tenant_id=tenant,
        model=ModelRef(id="llama-3-8b", revision="1"),
        tokenizer=TokenizerRef(id="llama-3", revision="1"),
        cache_config=CacheConfig(kv_dtype="bf16", block_size=16),
    )


def filled(n: int, policies: list[PolicySet]) -> Custody:
    def policy_for(tenant: str) -> TenantPolicy:
        return policies[0].policy_for(tenant)  # looked up per call: the run swaps the set

    c = Custody(n, policy=policy_for, tagger=DERIVER.scope_tag)
    scopes = [scope(f"t{i}") for i in range(TENANTS)]
    for r, first in enumerate(range(0, n, PER_REQUEST)):
        blocks = list(range(first, min(first + PER_REQUEST, n)))
        rid = f"r{r}"
        c.begin(rid, scopes[r % TENANTS], use_cache=True)
        c.allocate(rid, blocks, float(r) * 1e-3)
        c.mark_hashed(blocks)
        c.finish(rid, float(r) * 1e-3)
    c.take_events()
    return c


def timed(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    args = ap.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )
    print(
        f"{'cached':>8}{'summary us':>12}{'nothing due us':>16}{'1 tenant shortened us':>23}"
        f"{'all expire ms':>15}"
    )
    for n in args.blocks:
        policies = [PolicySet()]
        c = filled(n, policies)
        summary = timed(c.summary)
        idle = timed(lambda c=c: c.sweep(100.0))
        policies[0] = PolicySet(
            tenants={"t0": TenantPolicy(retention=Retention(ttl_s=10, idle_s=10))}
        )
        start = time.perf_counter()
        gone = c.sweep(200.0)
        shortened = (time.perf_counter() - start) * 1e6
        assert gone and all(c.record(b).owner.tenant_id == "t0" for b in gone)
        start = time.perf_counter()
        c.sweep(10_000.0)  # past every TTL
        everything = (time.perf_counter() - start) * 1e3
        print(f"{n:>8}{summary:>12.1f}{idle:>16.1f}{shortened:>23.1f}{everything:>15.1f}")


if __name__ == "__main__":
    main()
