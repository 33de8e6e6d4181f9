"""Cost of salt derivation per call: cached (same scope again) and uncached (a new scope each time).

Targets (issue 2): < 5 us per cached call and < 20 us uncached on the 2-core CPU machine.
Run: .venv/bin/python benchmarks/isolation_bench.py
"""

from __future__ import annotations

import platform
import statistics
import time

from kvguard.isolation import (
    CacheConfig,
    Keyring,
    ModelRef,
    SaltDeriver,
    Scope,
    TokenizerRef,
    chain_hashes,
)

N = 20_000
REPEATS = 5


def make_scopes(n: int) -> list[Scope]:
    model = ModelRef(id="meta-llama/Llama-3-8B", revision="main")
    tok = TokenizerRef(id="meta-llama/Llama-3-8B", revision="main")
    cfg = CacheConfig(kv_dtype="bf16", block_size=16)
    return [
        Scope(tenant_id=f"tenant-{i}", model=model, tokenizer=tok, cache_config=cfg)
        for i in range(n)
    ]


def per_call_us(fn, items) -> float:
    best = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        best.append((time.perf_counter() - t0) / len(items) * 1e6)
    return min(best)


def main() -> None:
    ring = Keyring.generate()
    scopes = make_scopes(N)
    uncached = []
    for _ in range(REPEATS):
        d = SaltDeriver(ring)  # fresh cache each repeat: every call derives
        t0 = time.perf_counter()
        for s in scopes:
            d.salt(s)
        uncached.append((time.perf_counter() - t0) / N * 1e6)
    warm = SaltDeriver(ring)
    for s in scopes:
        warm.salt(s)
    cached = per_call_us(warm.salt, scopes)
    tag = per_call_us(warm.scope_tag, scopes)
    tokens = list(range(2048))
    t0 = time.perf_counter()
    for _ in range(200):
        chain_hashes(tokens, 16, "k1:salt")
    chain_us = (time.perf_counter() - t0) / 200 * 1e6
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}"
    )
    print(f"{'operation':<40}{'us/call':>10}")
    print(f"{'salt, uncached (best of 5)':<40}{min(uncached):>10.2f}")
    print(f"{'salt, uncached (median of 5)':<40}{statistics.median(uncached):>10.2f}")
    print(f"{'salt, cached':<40}{cached:>10.2f}")
    print(f"{'scope_tag, cached':<40}{tag:>10.2f}")
    print(f"{'chain_hashes, 2048 tokens / 128 blocks':<40}{chain_us:>10.2f}")


if __name__ == "__main__":
    main()
