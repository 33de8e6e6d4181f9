"""AES-256-GCM throughput of the offload tier on this host (issue 15 item 6, the host part).

Measures `EncryptedTier.put` (encrypt + store in memory) and `get` (authenticate + decrypt) for block
payloads shaped like real KV blocks, against a plain `bytes` copy of the same payload as the floor:

- tiny Llama (the CPU engine's test model): 2 layers x K and V x 32 tokens x 2 KV heads x 64 x bf16;
- Llama-3-8B, one block of 16 tokens: 32 layers x K and V x 16 x 8 KV heads x 128 x bf16 = 2 MiB.

Run: .venv/bin/python benchmarks/offload_crypto.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from kvguard.isolation.keyring import Keyring
from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeys

SHAPES = {
    "tiny Llama block (32 tok)": 2 * 2 * 32 * 2 * 64 * 2,
    "Llama-3-8B block (16 tok)": 32 * 2 * 16 * 8 * 128 * 2,
}


def rate(fn, nbytes: int, seconds: float) -> float:  # type: ignore[no-untyped-def]
    """GB/s of `fn` over at least `seconds` (after one warm-up call)."""
    fn(0)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn(done)
        done += 1
    return done * nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    rows = []
    for name, size in SHAPES.items():
        payload = os.urandom(size)
        tier = EncryptedTier(
            OffloadKeys(Keyring.generate()), budget_bytes=64 * size + (1 << 20), clock=time.time
        )
        addresses = [BlockAddress(b"domain", "st_x", os.urandom(32), (0, 32), i) for i in range(64)]

        def put(i: int, t: EncryptedTier = tier, p: bytes = payload, a: list = addresses) -> None:
            t.put(a[i % 64], p)

        put_gbs = rate(put, size, args.seconds)

        def get(i: int, t: EncryptedTier = tier, a: list = addresses) -> None:
            t.get(a[i % 64])

        get_gbs = rate(get, size, args.seconds)
        copy_gbs = rate(lambda _i, p=payload: bytearray(p), size, args.seconds)
        rows.append((name, size, put_gbs, get_gbs, copy_gbs))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )
    print(f"{'payload':<28}{'bytes':>10}{'put GB/s':>10}{'get GB/s':>10}{'copy GB/s':>11}")
    for name, size, put_gbs, get_gbs, copy_gbs in rows:
        print(f"{name:<28}{size:>10}{put_gbs:>10.2f}{get_gbs:>10.2f}{copy_gbs:>11.2f}")


if __name__ == "__main__":
    main()
