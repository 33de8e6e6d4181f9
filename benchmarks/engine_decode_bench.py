"""Engine-shaped benchmark (issue 14, item 3): does kvguard's zeroization slow a decode loop down?

A decode loop shaped like Llama-3-8B (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336,
vocabulary 128,256, bf16) over a paged bf16 KV cache in vLLM's CUDA flash layout
(`[2, num_blocks, 16, 8, 128]` per layer): per layer an RMS norm, the QKV GEMM, the new token's K and V
written into its slot through the block table, paged decode attention reading the context through the
block table (a Triton kernel, one program per sequence and KV head), the output GEMM and the gated MLP;
then the LM head and an argmax whose result the host reads one step later (as an engine with
asynchronous scheduling does: the host prepares step s+1 while the GPU runs step s).

Every step frees N context blocks (random, scattered) and re-allocates N blocks from the free list in
their place (the block table is uploaded every step). Variants, measured side by side in one run,
alternating in rounds:

- `plain`: freed blocks go straight back to the free list (what vLLM does: the next owner gets the old
  bytes);
- `kvguard`: the freed blocks are quarantined and handed to `kvguard.zeroize.stepper.StepZeroizer`
  exactly as the vLLM worker hook does (`submit(release=..., verify=...)` before the forward pass,
  `collect()` after it); they return to the free list when their verdict arrives (usually one step
  later), so the clear and its sampled read-back run in stream order with no host synchronization;
- `kvguard-handover`: freed blocks go back at once with their residue, and the re-allocated ones are
  cleared as a handover (`submit(handover=...)`, verified in full) before the forward pass;
- `index_fill_`: `layer.index_fill_(1, ids, 0)` per layer, no verification (the naive clear);
- `sync`: the synchronous `kvguard.zeroize.zeroize` per step (the behaviour before issue 14: the host
  waits for the clear, and so for the whole queue in front of it).

Needs only torch and Triton (no vLLM). On a GPU:

    PYTHONPATH=. python benchmarks/engine_decode_bench.py [--json PATH]

`--smoke` runs a tiny model on whatever device there is (CPU: set TRITON_INTERPRET=1) to check the
loop and the attention kernel against a torch reference.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import triton
import triton.language as tl

from kvguard.zeroize import KVCacheSpec, plan_zeroize, zeroize
from kvguard.zeroize.stepper import StepZeroizer

VARIANTS = ("plain", "kvguard", "kvguard-handover", "index_fill_", "sync")


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head: int = 128
    ffn: int = 14336
    vocab: int = 128256
    block: int = 16
    batch: int = 64
    context: int = 1024  # tokens per sequence when the timed loop starts
    num_blocks: int = 8192  # 16 GiB of cache at the 8B shape


SMOKE = Shape(layers=2, hidden=64, heads=4, kv_heads=2, head=16, ffn=128, vocab=256, block=16,
              batch=3, context=40, num_blocks=64)  # fmt: skip


# ruff: noqa: N803 (Triton's upper-case constexpr parameters)
@triton.jit
def paged_decode_kernel(
    q,  # [batch, heads, HEAD] bf16
    k_cache,  # [num_blocks, BLOCK, KV_HEADS, HEAD] bf16 (the K half of one layer)
    v_cache,  # same shape, the V half
    block_table,  # [batch, table_width] int32
    context_lens,  # [batch] int32
    out,  # [batch, heads, HEAD] bf16
    table_width,
    scale,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD)
    tokens = tl.arange(0, BLOCK)
    heads = kv_head * GROUP + group
    q_offsets = (seq * KV_HEADS * GROUP + heads)[:, None] * HEAD + dims[None, :]
    query = tl.load(q + q_offsets).to(tl.float32)  # [GROUP, HEAD]
    length = tl.load(context_lens + seq)
    best = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD], tl.float32)
    for index in range(0, tl.cdiv(length, BLOCK)):
        block = tl.load(block_table + seq * table_width + index).to(tl.int64)
        offsets = ((block * BLOCK + tokens) * KV_HEADS + kv_head)[:, None] * HEAD + dims[None, :]
        keys = tl.load(k_cache + offsets).to(tl.float32)  # [BLOCK, HEAD]
        values = tl.load(v_cache + offsets).to(tl.float32)
        scores = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scale  # [GROUP, BLOCK]
        scores = tl.where((index * BLOCK + tokens < length)[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_best[:, None])
        alpha = tl.exp(best - new_best)
        total = total * alpha + tl.sum(weights, axis=1)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        best = new_best
    tl.store(out + q_offsets, (acc / total[:, None]).to(out.dtype.element_ty))


class Model:
    """Random Llama-shaped weights and a paged cache; `step` runs one decode step."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        s, dt = shape, torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=device, dtype=dt)
            return w.mul_(1 / math.sqrt(rows))

        qkv = (s.heads + 2 * s.kv_heads) * s.head
        self.layers = [
            (weight(s.hidden, qkv), weight(s.heads * s.head, s.hidden),
             weight(s.hidden, 2 * s.ffn), weight(s.ffn, s.hidden))
            for _ in range(s.layers)
        ]  # fmt: skip
        self.lm_head = weight(s.hidden, s.vocab)
        self.norm = torch.ones(s.hidden, device=device, dtype=dt)
        self.cache = []
        for _ in range(s.layers):
            layer = torch.empty(
                (2, s.num_blocks, s.block, s.kv_heads, s.head), device=device, dtype=dt
            )
            layer.normal_(generator=gen)  # never time on zeros
            self.cache.append(layer)
        self.spec = KVCacheSpec.vllm_flash(self.cache)
        self.embedding = torch.randn(s.batch, s.hidden, generator=gen, device=device, dtype=dt)

    def _rms(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.norm)

    def step(self, table: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        s = self.shape
        x = self.embedding
        group = s.heads // s.kv_heads
        for (w_qkv, w_o, w_gu, w_down), layer in zip(self.layers, self.cache, strict=True):
            qkv = self._rms(x) @ w_qkv
            q, k, v = qkv.split([s.heads * s.head, s.kv_heads * s.head, s.kv_heads * s.head], 1)
            flat = layer.view(2, s.num_blocks * s.block, s.kv_heads, s.head)
            flat[0].index_copy_(0, slots, k.view(-1, s.kv_heads, s.head))
            flat[1].index_copy_(0, slots, v.view(-1, s.kv_heads, s.head))
            attn = torch.empty(s.batch, s.heads, s.head, device=self.device, dtype=x.dtype)
            paged_decode_kernel[(s.batch, s.kv_heads)](
                q.contiguous(), layer[0], layer[1], table, lens, attn, table.shape[1],
                1 / math.sqrt(s.head), s.kv_heads, group, s.head, s.block, num_warps=4,
            )  # fmt: skip
            x = x + attn.view(s.batch, -1) @ w_o
            gate, up = (self._rms(x) @ w_gu).chunk(2, dim=1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w_down
        return (self._rms(x) @ self.lm_head).argmax(dim=1)


@dataclass
class Engine:
    """Host-side state of one run: block tables, free list, quarantine (the variant decides)."""

    model: Model
    variant: str
    churn: int
    steps_total: int
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    kvguard_host_us: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        s = self.model.shape
        width = -(-(s.context + self.steps_total + 1) // s.block)
        ids = list(range(s.num_blocks))
        self.rng.shuffle(ids)
        self.table = [ids[i * width : (i + 1) * width] for i in range(s.batch)]
        self.free: collections.deque[int] = collections.deque(ids[s.batch * width :])
        self.position = s.context
        # Two pinned staging buffers, alternating: the host writes step s+1's while step s's copy may
        # still be queued; step s-1's has finished (its tokens were read before this step began).
        self.pinned = [
            torch.empty(
                s.batch * width + 2 * s.batch,
                dtype=torch.int32,
                pin_memory=self.model.device.type == "cuda",
            )
            for _ in range(2)
        ]
        self.clears = StepZeroizer(self.model.spec) if self.variant.startswith("kvguard") else None
        self.lagged: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def _churn(self) -> tuple[list[int], list[int]]:
        s = self.model.shape
        full = self.position // s.block  # context blocks, all written
        freed, taken = [], []
        for seq, index in self.rng.sample([(b, j) for b in range(s.batch) for j in range(full)],
                                          self.churn):  # fmt: skip
            freed.append(self.table[seq][index])
            self.table[seq][index] = self.free.popleft()
            taken.append(self.table[seq][index])
        return freed, taken

    def _upload(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, device = self.model.shape, self.model.device
        width = len(self.table[0])
        rows = [b for row in self.table for b in row]
        slots = [
            row[self.position // s.block] * s.block + self.position % s.block for row in self.table
        ]
        host = self.pinned[self.position % 2]
        host[: len(rows)] = torch.tensor(rows, dtype=torch.int32)
        host[len(rows) : len(rows) + s.batch] = self.position + 1
        host[len(rows) + s.batch : len(rows) + 2 * s.batch] = torch.tensor(slots, dtype=torch.int32)
        dev = host.to(device, non_blocking=True)
        table = dev[: len(rows)].view(s.batch, width)
        lens = dev[len(rows) : len(rows) + s.batch]
        return table, lens, dev[len(rows) + s.batch :].long()

    def _zeroize(self, freed: list[int], taken: list[int]) -> None:
        started = time.perf_counter()
        if self.variant == "kvguard":
            assert self.clears is not None
            self.clears.submit(release=freed, verify="sample")  # held until the verdict
        elif self.variant == "kvguard-handover":
            assert self.clears is not None
            self.free.extend(freed)  # with residue: cleared when handed over
            self.clears.submit(handover=taken)
        elif self.variant == "sync":
            zeroize(
                self.model.spec, plan_zeroize(freed, self.model.shape.num_blocks), verify="sample"
            )
            self.free.extend(freed)
        elif self.variant == "index_fill_":
            ids = torch.tensor(freed, dtype=torch.int64).to(self.model.device, non_blocking=True)
            for layer in self.model.cache:
                layer.index_fill_(1, ids, 0)
            self.free.extend(freed)
        else:
            self.free.extend(freed)
        if self.variant != "plain":
            self.kvguard_host_us.append((time.perf_counter() - started) * 1e6)

    def step(self) -> None:
        freed, taken = self._churn() if self.churn else ([], [])
        table, lens, slots = self._upload()
        self._zeroize(freed, taken)
        tokens = self.model.step(table, lens, slots)
        if self.clears is not None:  # the worker's take_results, after the forward is enqueued
            started = time.perf_counter()
            for result in self.clears.collect():
                if not result.ok:
                    raise RuntimeError(f"verification failed for {len(result.blocks)} blocks")
                if not result.handover:
                    self.free.extend(result.blocks)
            self.kvguard_host_us[-1] += (time.perf_counter() - started) * 1e6
        self._read_lagged(tokens)
        self.position += 1

    def _read_lagged(self, tokens: torch.Tensor) -> None:
        """Read the previous step's tokens (the host runs one step ahead, as async scheduling does)."""
        if self.lagged is not None:
            host, done = self.lagged
            if done is not None:
                done.synchronize()
            host.tolist()
        host = tokens.to("cpu", non_blocking=True)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        self.lagged = (host, done)

    def finish(self) -> None:
        if self.clears is not None:
            self.clears.drain()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(model: Model, variant: str, churn: int, steps: int, warmup: int) -> dict[str, float]:
    engine = Engine(model, variant, churn, warmup + steps)
    for _ in range(warmup):
        engine.step()
    sync(model.device)
    engine.kvguard_host_us.clear()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.finish()
    sync(model.device)
    elapsed = time.perf_counter() - started
    host = engine.kvguard_host_us
    return {
        "tokens_per_s": model.shape.batch * steps / elapsed,
        "ms_per_step": elapsed / steps * 1e3,
        "kvguard_host_us_median": statistics.median(host) if host else 0.0,
    }


def check_attention(model: Model) -> float:
    """Relative error of the paged kernel against gather + softmax in float32 (one layer)."""
    s, device = model.shape, model.device
    engine = Engine(model, "plain", 0, 1)
    table, lens, _slots = engine._upload()
    q = torch.randn(s.batch, s.heads, s.head, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    layer = model.cache[0]
    paged_decode_kernel[(s.batch, s.kv_heads)](
        q, layer[0], layer[1], table, lens, out, table.shape[1], 1 / math.sqrt(s.head),
        s.kv_heads, s.heads // s.kv_heads, s.head, s.block, num_warps=4,
    )  # fmt: skip
    worst = 0.0
    for b in range(s.batch):
        n = int(lens[b])
        rows = table[b, : -(-n // s.block)].long()
        k = layer[0][rows].reshape(-1, s.kv_heads, s.head)[:n].float()
        v = layer[1][rows].reshape(-1, s.kv_heads, s.head)[:n].float()
        group = s.heads // s.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) / math.sqrt(s.head)
        ref = torch.einsum("ht,thd->hd", scores.softmax(dim=1), v)
        worst = max(worst, float((out[b].float() - ref).norm() / ref.norm()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--churn", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--smoke", action="store_true", help="tiny model, any device")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE if args.smoke else Shape()
    if args.smoke:
        args.churn, args.steps, args.warmup, args.rounds = [1, 4], 3, 1, 1
    env = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "shape": asdict(shape)}  # fmt: skip
    print("env", json.dumps(env), flush=True)
    model = Model(shape, device)
    error = check_attention(model)
    print(f"paged attention vs float32 reference: max relative error {error:.2e}", flush=True)
    if error > 2e-2 or math.isnan(error):
        raise SystemExit("paged attention kernel is wrong")
    rows = measure(model, args)
    report = {"env": env, "attention_rel_error": error, "rows": rows}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    print_table(rows, args.variants, args.churn)


def measure(model: Model, args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for round_index in range(args.rounds):
        for churn in args.churn:
            order = (
                args.variants[round_index % len(args.variants) :]
                + args.variants[: round_index % len(args.variants)]
            )  # rotate the order each round
            for variant in order:
                result = run_one(model, variant, churn, args.steps, args.warmup)
                row: dict[str, object] = {
                    "round": round_index,
                    "churn": churn,
                    "variant": variant,
                    **result,
                }
                rows.append(row)
                print("run", json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict[str, object]], variants: list[str], churns: list[int]) -> None:
    def median(variant: str, churn: int, key: str) -> float:
        values = [float(r[key]) for r in rows if r["variant"] == variant and r["churn"] == churn]  # type: ignore[arg-type]
        return statistics.median(values)

    def ratios(variant: str, churn: int) -> list[float]:
        """Tokens/s over plain's in the same round: the pairs ran back to back."""
        by_round = {
            (r["round"], r["variant"]): float(r["tokens_per_s"])  # type: ignore[arg-type]
            for r in rows
            if r["churn"] == churn
        }
        rounds = sorted({key[0] for key in by_round})
        return [by_round[(i, variant)] / by_round[(i, "plain")] for i in rounds]

    print()
    print(f"{'N':>5} {'variant':18} {'tok/s':>9} {'ms/step':>8} {'vs plain (per round)':>28} "
          f"{'host us':>8}")  # fmt: skip
    for churn in churns:
        for variant in variants:
            tps = median(variant, churn, "tokens_per_s")
            per_round = ratios(variant, churn) if "plain" in variants else []
            text = f"{statistics.median(per_round):.4f} " + "/".join(f"{x:.3f}" for x in per_round)
            print(f"{churn:5d} {variant:18} {tps:9.1f} {median(variant, churn, 'ms_per_step'):8.2f} "
                  f"{text:>28} {median(variant, churn, 'kvguard_host_us_median'):8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
