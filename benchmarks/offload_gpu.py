"""Offload tier on a GPU: the cost of moving and encrypting KV blocks (issue 15 item 6, GPU part).

A paged bf16 KV cache in vLLM's flash layout (per layer `[2, num_blocks, block_size, kv_heads,
head_dim]`; default Llama-3-8B: 32 layers, 16 tokens, 8 KV heads of 128, i.e. 2 MiB per block) is
filled with random bytes. For batches of N scattered blocks (default N in 1, 16, 64, 256) it measures:

(a) **D2H**: the blocks of every layer gathered on the device into a preallocated staging buffer laid
    out block-major (`[N, layers, K/V, chunk]`: one block's bytes are contiguous, in the connector's
    segment order, layer 0 K, layer 0 V, layer 1 K, ...) with one `index_select` per layer, then one
    copy into pinned host memory; the block ids' upload is included;
(b) **encrypt**: `EncryptedTier.put` of each block's payload (a zero-copy view of the pinned buffer),
    AES-256-GCM under the domain's data key, stored in memory;
(c) **decrypt + H2D**: `EncryptedTier.get` of each block (authenticate, decrypt), its plaintext copied
    into a pinned staging buffer, one host-to-device copy and one `index_copy_` per layer into N other
    (fresh) blocks of the paged cache; every repetition checks on the device that the restored blocks
    equal the originals byte for byte;
(d) spill (a + b) and restore (c) per block and per token, against a *reference* recompute figure
    measured on the same device in the same run: a GEMM-only prefill proxy, `layers` x (x @ W_qkv
    [hidden x qkv_out] + x @ W_gate, x @ W_up [hidden x mlp] + h @ W_down [mlp x hidden]) in bf16 for
    T tokens (T = block_size, and T = N x block_size, as a recompute of N blocks would batch them).
    It leaves out attention, norms and everything else of a real prefill, so real recompute costs more.

For comparison it also times the connector's own copy path (`kvguard.offload.blocks.BlockCopier`,
what the worker's tier calls: one gather per segment into device staging, one transpose, one copy
into pinned host memory, payloads as views of it; back: payloads into pinned memory, one upload, one
`index_copy_` per segment), and checks that its payload bytes are the same as (a)'s.

Run (GPU host): PYTHONPATH=. python benchmarks/offload_gpu.py
Run (anywhere, small shapes, no GPU): PYTHONPATH=. python benchmarks/offload_gpu.py --device cpu --small
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import numpy as np
import torch

from kvguard.isolation.keyring import Keyring
from kvguard.offload import BlockAddress, EncryptedTier, OffloadKeys


@dataclass
class Cache:
    """The paged cache: bf16 layer tensors and their `[2, num_blocks, chunk]` uint8 views."""

    layers: list[torch.Tensor]
    u8: list[torch.Tensor]
    num_blocks: int
    chunk: int  # bytes of one block's K (or V) in one layer

    @property
    def block_bytes(self) -> int:
        return len(self.layers) * 2 * self.chunk


@dataclass
class Samples:
    """Seconds per repetition for each measured stage."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.values.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.values[name])


def build_cache(args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> Cache:
    shape = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
    layers, u8 = [], []
    for _ in range(args.layers):
        raw = torch.randint(
            -(2**31),
            2**31 - 1,
            (int(np.prod(shape)) // 2,),
            dtype=torch.int32,
            generator=gen,
            device=device,
        )
        layer = raw.view(torch.bfloat16).view(shape)
        layers.append(layer)
        u8.append(layer.view(torch.uint8).view(2, args.num_blocks, -1))
    chunk = args.block_size * args.kv_heads * args.head_dim * 2
    return Cache(layers, u8, args.num_blocks, chunk)


class Mover:
    """(a) and (c): staging buffers, device gathers and scatters, the two host copies."""

    def __init__(self, cache: Cache, max_blocks: int, device: torch.device) -> None:
        self.cache = cache
        self.device = device
        self.cuda = device.type == "cuda"
        shape = (max_blocks, len(cache.layers), 2, cache.chunk)
        self.dev_out = torch.empty(shape, dtype=torch.uint8, device=device)
        self.dev_in = torch.empty(shape, dtype=torch.uint8, device=device)
        self.host_out = torch.empty(shape, dtype=torch.uint8, pin_memory=self.cuda)
        self.host_in = torch.empty(shape, dtype=torch.uint8, pin_memory=self.cuda)
        self.host_out_np = self.host_out.numpy().reshape(max_blocks, -1)
        self.host_in_np = self.host_in.numpy().reshape(max_blocks, -1)
        self.strided_out = self._probe_strided_out()

    def _probe_strided_out(self) -> bool:
        """Whether `index_select(out=)` writes straight into the block-major staging view (one kernel
        per layer); otherwise each layer is gathered to a temporary and copied (two)."""
        idx = torch.tensor([1, 0], dtype=torch.long, device=self.device)
        try:
            for layer, src in enumerate(self.cache.u8):
                torch.index_select(src, 1, idx, out=self.dev_out[:2, layer].transpose(0, 1))
        except RuntimeError:
            return False
        want = torch.stack([u.index_select(1, idx).transpose(0, 1) for u in self.cache.u8], dim=1)
        return bool(torch.equal(self.dev_out[:2], want))

    def ids(self, block_ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(block_ids).to(self.device)

    def gather(self, idx: torch.Tensor) -> None:
        n = idx.numel()
        for layer, src in enumerate(self.cache.u8):
            dst = self.dev_out[:n, layer].transpose(0, 1)
            if self.strided_out:
                torch.index_select(src, 1, idx, out=dst)
            else:
                dst.copy_(src.index_select(1, idx))

    def to_host(self, n: int) -> None:
        self.host_out[:n].copy_(self.dev_out[:n], non_blocking=self.cuda)

    def payload(self, i: int) -> bytes:
        # A zero-copy view of block i's bytes in pinned memory; AESGCM takes any buffer.
        return cast(bytes, memoryview(self.host_out_np[i]))

    def to_device(self, n: int) -> None:
        self.dev_in[:n].copy_(self.host_in[:n], non_blocking=self.cuda)

    def scatter(self, idx: torch.Tensor) -> None:
        n = idx.numel()
        for layer, dst in enumerate(self.cache.u8):
            dst.index_copy_(1, idx, self.dev_in[:n, layer].transpose(0, 1))


class ConnectorCopier:
    """The connector's own copy path: `kvguard.offload.blocks.BlockCopier`, on the same cache."""

    def __init__(self, cache: Cache) -> None:
        from kvguard.offload.blocks import BlockCopier  # noqa: PLC0415
        from kvguard.zeroize import KVCacheSpec  # noqa: PLC0415

        self.copier = BlockCopier(KVCacheSpec.vllm_flash(cache.layers))

    def read(self, block_ids: list[int]) -> list[memoryview]:
        return self.copier.read(block_ids)  # views of its pinned buffer, as the worker uses them

    def write(self, block_ids: list[int], payloads: list[memoryview]) -> None:
        self.copier.write(block_ids, payloads)


def blocks_equal(cache: Cache, a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(bool(torch.equal(u.index_select(1, a), u.index_select(1, b))) for u in cache.u8)


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def connector_round_trip(
    n: int,
    rep: int,
    connector: ConnectorCopier,
    cache: Cache,
    mover: Mover,
    src_np: np.ndarray,
    dst_np: np.ndarray,
    rec: dict[str, float],
    sync: Callable[[], None],
) -> None:
    """The connector's path on the same blocks: read `src`, write the payloads into `dst`."""
    src_l, dst_l = src_np.tolist(), dst_np.tolist()
    payloads: list[memoryview] = []
    rec["conn_read"] = timed(lambda: payloads.extend(connector.read(src_l)), sync)
    if rep == 0 and any(
        p.tobytes() != mover.host_out_np[i].tobytes() for i, p in enumerate(payloads)
    ):
        sys.exit(f"the connector's payload layout differs from the staging one (N={n})")
    rec["conn_write"] = timed(lambda: connector.write(dst_l, payloads), sync)
    if not blocks_equal(cache, mover.ids(src_np), mover.ids(dst_np)):
        sys.exit(f"connector round trip FAILED: N={n}, repetition {rep}")


def measure_batch(
    n: int,
    reps: int,
    cache: Cache,
    mover: Mover,
    connector: ConnectorCopier | None,
    tier: EncryptedTier,
    addresses: list[BlockAddress],
    rng: np.random.Generator,
    sync: Callable[[], None],
) -> Samples:
    samples = Samples()
    for rep in range(reps + 1):  # repetition 0 warms up and is not recorded
        chosen = rng.choice(cache.num_blocks, size=2 * n, replace=False).astype(np.int64)
        src_np, dst_np = chosen[:n], chosen[n:]
        rec: dict[str, float] = {}

        # (a) gather on the device + one copy into pinned memory (ids upload included)
        sync()
        t0 = time.perf_counter()
        src = mover.ids(src_np)
        mover.gather(src)
        sync()
        t1 = time.perf_counter()
        mover.to_host(n)
        sync()
        t2 = time.perf_counter()
        rec["gather"], rec["d2h_copy"], rec["d2h"] = t1 - t0, t2 - t1, t2 - t0

        # (b) encrypt and store every block
        rec["encrypt"] = timed(
            lambda: [tier.put(addresses[i], mover.payload(i)) for i in range(n)], sync
        )

        # (c) authenticate + decrypt into pinned memory, one copy, scatter into fresh blocks
        def decrypt() -> None:
            for i in range(n):
                plain = tier.get(addresses[i])
                assert plain is not None
                mover.host_in_np[i] = np.frombuffer(plain, dtype=np.uint8)

        rec["decrypt"] = timed(decrypt, sync)
        sync()
        t0 = time.perf_counter()
        mover.to_device(n)
        sync()
        t1 = time.perf_counter()
        dst = mover.ids(dst_np)
        mover.scatter(dst)
        sync()
        t2 = time.perf_counter()
        rec["h2d_copy"], rec["scatter"], rec["h2d"] = t1 - t0, t2 - t1, t2 - t0
        if not blocks_equal(cache, src, dst):
            sys.exit(f"round trip FAILED: N={n}, repetition {rep}: restored blocks differ")

        if connector is not None:
            connector_round_trip(n, rep, connector, cache, mover, src_np, dst_np, rec, sync)

        if rep > 0:
            for name, seconds in rec.items():
                samples.add(name, seconds)
    return samples


def prefill_proxy(
    args: argparse.Namespace,
    device: torch.device,
    tokens: list[int],
    sync: Callable[[], None],
) -> dict[int, float]:
    """Median seconds of the GEMM-only prefill proxy for each token count."""
    dtype = torch.bfloat16
    scale = args.hidden**-0.5
    weights = [
        (
            torch.randn(args.hidden, args.qkv_out, device=device, dtype=dtype) * scale,
            torch.randn(args.hidden, args.mlp, device=device, dtype=dtype) * scale,
            torch.randn(args.hidden, args.mlp, device=device, dtype=dtype) * scale,
            torch.randn(args.mlp, args.hidden, device=device, dtype=dtype) * args.mlp**-0.5,
        )
        for _ in range(args.layers)
    ]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for w_qkv, w_gate, w_up, w_down in weights:
            _qkv = x @ w_qkv
            x = (x @ w_gate) * (x @ w_up) @ w_down
        return x

    out: dict[int, float] = {}
    for t in tokens:
        x = torch.randn(t, args.hidden, device=device, dtype=dtype)
        for _ in range(3):
            forward(x)
        reps = 20 if t <= 256 else 8
        out[t] = statistics.median(timed(partial(forward, x), sync) for _ in range(reps))
    weights.clear()
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a quick check anywhere")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--batches", default="1,16,64,256", help="block counts N, comma-separated")
    ap.add_argument("--hidden", type=int, default=4096, help="prefill proxy: model width")
    ap.add_argument("--qkv-out", type=int, default=None, help="prefill proxy: default 3 x hidden")
    ap.add_argument("--mlp", type=int, default=14336, help="prefill proxy: MLP width")
    ap.add_argument("--target-blocks", type=int, default=512, help="repetitions = this / N ...")
    ap.add_argument("--min-reps", type=int, default=5, help="... but at least this many")
    ap.add_argument("--no-connector", action="store_true", help="skip the connector-path rows")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.small:
        args.layers, args.kv_heads, args.head_dim, args.num_blocks = 4, 2, 64, 96
        args.batches, args.hidden, args.mlp = "1,4,16", 256, 512
    if args.qkv_out is None:
        args.qkv_out = 3 * args.hidden
    args.batch_list = [int(b) for b in args.batches.split(",")]
    if 2 * max(args.batch_list) > args.num_blocks:
        ap.error("--num-blocks must be at least twice the largest batch")
    return args


def main() -> None:
    args = parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --device cpu (and --small) to check the script")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)

    import cryptography  # noqa: PLC0415  (only for its version)

    card = torch.cuda.get_device_name(device) if cuda else "none"
    print(f"device: {device} ({card}), torch {torch.__version__}, cuda {torch.version.cuda}")
    print(
        f"host: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
        f"cryptography {cryptography.__version__}"
    )
    if not cuda:
        print(
            "NOTE: no GPU in use: pinned memory, device copies and device GEMMs are skipped; the"
            " 'D2H' / 'H2D' figures below are host memcpy and the recompute proxy runs on the CPU."
            " Only GPU runs give the numbers this benchmark is for."
        )

    cache = build_cache(args, device, gen)
    max_n = max(args.batch_list)
    mover = Mover(cache, max_n, device)
    connector = None if args.no_connector else ConnectorCopier(cache)
    block_bytes = cache.block_bytes
    print(
        f"cache: {args.layers} layers x [2, {args.num_blocks}, {args.block_size}, {args.kv_heads},"
        f" {args.head_dim}] bf16 ({args.layers * 2 * args.num_blocks * cache.chunk / 2**30:.2f} GiB),"
        f" {block_bytes} bytes per block ({block_bytes / args.block_size:.0f} per token)"
    )
    print(
        "gather: "
        + (
            "index_select(out=) straight into the block-major staging buffer, one kernel per layer"
            if mover.strided_out
            else "index_select to a temporary + copy_ into the staging buffer, per layer"
        )
    )

    keys = OffloadKeys(Keyring.generate())
    tier = EncryptedTier(keys, budget_bytes=2 * max_n * (block_bytes + 64), clock=time.monotonic)
    addresses = [
        BlockAddress(b"bench-domain", "st_bench", os.urandom(32), (0, args.layers), i)
        for i in range(max_n)
    ]

    results: dict[int, Samples] = {}
    for n in args.batch_list:
        reps = max(args.min_reps, args.target_blocks // n)
        results[n] = measure_batch(n, reps, cache, mover, connector, tier, addresses, rng, sync)
        print(f"N={n}: {reps} repetitions, round trip exact in every one")
    tier.close()

    tokens = sorted({args.block_size} | {n * args.block_size for n in args.batch_list})
    del mover, connector, cache
    if cuda:
        torch.cuda.empty_cache()
    proxy = prefill_proxy(args, device, tokens, sync)
    print(
        f"recompute reference (GEMM-only prefill proxy, {args.layers} layers x [{args.hidden}x"
        f"{args.qkv_out}, 2 x {args.hidden}x{args.mlp}, {args.mlp}x{args.hidden}] bf16; no attention):"
    )
    for t, seconds in proxy.items():
        flops = 2 * t * args.layers * args.hidden * (args.qkv_out + 3 * args.mlp)
        print(
            f"  T={t:>5} tokens: {seconds * 1e3:9.3f} ms, {seconds / t * 1e6:8.2f} us/token,"
            f" {flops / seconds / 1e12:7.1f} TFLOP/s"
        )

    def us(n: int, name: str) -> float:
        return results[n].median(name) * 1e6

    def gbs(n: int, name: str) -> float:
        return n * block_bytes / results[n].median(name) / 1e9

    print()
    print(
        "device split (median us per batch): gather | D2H copy (GB/s) | H2D copy (GB/s) | scatter"
    )
    for n in args.batch_list:
        print(
            f"  N={n:<4} {us(n, 'gather'):9.1f} | {us(n, 'd2h_copy'):9.1f} ({gbs(n, 'd2h_copy'):5.1f})"
            f" | {us(n, 'h2d_copy'):9.1f} ({gbs(n, 'h2d_copy'):5.1f}) | {us(n, 'scatter'):8.1f}"
        )
    if not args.no_connector:
        print("connector's current copy path (BlockCopier), us per block (GB/s): read | write")
        for n in args.batch_list:
            print(
                f"  N={n:<4} {us(n, 'conn_read') / n:8.1f} ({gbs(n, 'conn_read'):5.2f})"
                f" | {us(n, 'conn_write') / n:8.1f} ({gbs(n, 'conn_write'):5.2f})"
            )

    bs = args.block_size
    print()
    print(
        "us per block (GB/s); spill = D2H + encrypt, restore = decrypt + H2D;"
        f" per token = per block / {bs}; recompute = proxy us/token at T={bs} and at T=N x {bs}"
    )
    head = (
        f"{'N':>4} {'D2H':>14} {'encrypt':>14} {'decrypt':>14} {'H2D':>14} {'spill':>8}"
        f" {'restore':>8} {'spill/tok':>10} {'rest./tok':>10} {'rec/tok@' + str(bs):>11}"
        f" {'rec/tok@N':>10}"
    )
    print(head)
    for n in args.batch_list:
        spill = (us(n, "d2h") + us(n, "encrypt")) / n
        restore = (us(n, "decrypt") + us(n, "h2d")) / n
        cells = [
            f"{us(n, s) / n:7.1f} ({gbs(n, s):4.1f})" for s in ("d2h", "encrypt", "decrypt", "h2d")
        ]
        print(
            f"{n:>4} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} {cells[3]:>14} {spill:8.1f}"
            f" {restore:8.1f} {spill / bs:10.2f} {restore / bs:10.2f}"
            f" {proxy[bs] / bs * 1e6:11.2f} {proxy[n * bs] / (n * bs) * 1e6:10.2f}"
        )


if __name__ == "__main__":
    main()
