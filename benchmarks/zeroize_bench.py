"""Zeroization benchmark (issue 4, item 7; issue 14, item 2): the one-launch Triton kernel against its
ceilings and the naive alternatives, on Llama-3-8B and 70B KV cache shapes, and the host cost of one
call. Needs a CUDA GPU.

    PYTHONPATH=. python benchmarks/zeroize_bench.py [--sweep] [--json PATH]
    PYTHONPATH=. python benchmarks/zeroize_bench.py --host-only   # only the host-cost tables
    PYTHONPATH=. python benchmarks/zeroize_bench.py --plan-only   # the host-side planner, any machine

Host cost (8B shape). "enqueue" is the host time of `zeroize_async(cache, plan, verify=mode)`: what
an engine's step pays (issue 14 target: <= 30 us up to 64 blocks); "plan" is `plan_zeroize` before
it; "collect" is `poll()` + `evidence()` once the device has finished (paid at a later step); "sync"
is the whole synchronous `zeroize()` with the GPU idle. "queued" repeats one-block calls behind
~40 ms of queued GPU work: `zeroize_async` returns at once, `zeroize` waits for the queue. Medians.

Timing. "Device time" is CUDA-event time with the host kept ahead of the GPU: each repetition first
enqueues a ~2 ms spin kernel, so the events bracket only device work, never Python or launch gaps
(those are reported separately as "wall", host-synchronised per call). Medians of `--reps` runs.
Block ids are drawn at random (scattered, as real releases are), fresh for every repetition.
"""

from __future__ import annotations

import argparse
import array
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kvguard.zeroize import KVCacheSpec, plan, plan_zeroize, triton_exec, zeroize, zeroize_async
from kvguard.zeroize.triton_exec import Tuning

GIB = 1 << 30
FREES = (1, 16, 256, 2048)
SHAPES = {"llama3-8b": 32, "llama3-70b": 80}  # layers; both 8 KV heads, head 128, block 16, bf16
NUM_BLOCKS = 4096
SPIN_CYCLES = 4_000_000  # ~2 ms at H100 clocks: longer than any host-side enqueue measured here
HOST_COUNTS = (1, 16, 64, 256, 2048)
QUEUE_CYCLES = 80_000_000  # ~40 ms of queued work, as in issue 14's measurement


@dataclass
class Row:
    shape: str
    method: str
    blocks: int
    device_us: float
    tb_s: float
    wall_us: float | None = None


def device_us(fn: Callable[[int], object], reps: int) -> float:
    """Median device time of `fn(rep)`, the host kept ahead of the GPU by a spin kernel."""
    fn(-1)  # warm-up: compile, allocate
    pairs = []
    for rep in range(reps):
        torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn(rep)
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in pairs)) * 1000.0


def wall_us(fn: Callable[[int], object], reps: int) -> float:
    fn(-1)
    times = []
    for rep in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn(rep)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def make_cache(layers: int) -> KVCacheSpec:
    tensors = []
    for _ in range(layers):
        layer = torch.empty((2, NUM_BLOCKS, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
        layer.view(torch.int16).random_(1, 2**15)  # never zero (MLOps habit: never time on zeros)
        tensors.append(layer)
    return KVCacheSpec.vllm_flash(tensors)


def id_sets(count: int, reps: int) -> list[list[int]]:
    chooser = random.Random(count)
    return [chooser.sample(range(NUM_BLOCKS), count) for _ in range(reps + 1)]


def ceilings(reps: int) -> dict[str, float]:
    """Contiguous zero_() (write) and amax (read) over 8 GiB, in TB/s, same run, same card."""
    buffer = torch.empty(8 * GIB, dtype=torch.uint8, device="cuda")
    buffer.random_(1, 256)
    write = device_us(lambda _r: buffer.zero_(), reps)
    words = buffer.view(torch.int32)
    read = device_us(lambda _r: words.amax(), reps)
    copy_src, copy_dst = buffer[: 4 * GIB], buffer[4 * GIB :]
    copy = device_us(lambda _r: copy_dst.copy_(copy_src), reps)
    return {
        "zero_tb_s": 8 * GIB / write / 1e6,
        "read_tb_s": 8 * GIB / read / 1e6,
        "copy_tb_s": 8 * GIB / copy / 1e6,  # bytes read + written
    }


def bench_shape(name: str, spec: KVCacheSpec, reps: int) -> list[Row]:
    rows: list[Row] = []
    for count in FREES:
        rows += bench_count(name, spec, count, reps)
    return rows


def bench_count(name: str, spec: KVCacheSpec, count: int, reps: int) -> list[Row]:
    sets = id_sets(count, reps)
    plans = [sorted(ids) for ids in sets]
    indexes = [torch.tensor(ids, device="cuda") for ids in sets]
    nbytes = count * spec.bytes_per_block
    rows: list[Row] = []

    def add(method: str, t_us: float, w_us: float | None = None) -> None:
        rows.append(Row(name, method, count, t_us, nbytes / t_us / 1e6, w_us))

    def triton_zero(rep: int) -> None:
        triton_exec.zero_blocks(spec, plans[rep])

    def evidence_call(rep: int) -> None:
        zeroize(spec, plan_zeroize(sets[rep], NUM_BLOCKS), verify="none")

    def index_fill(rep: int) -> None:
        for layer in spec.layers:
            layer.index_fill_(1, indexes[rep], 0)

    def per_block(rep: int) -> None:
        for block in sets[rep]:
            for layer in spec.layers:
                layer[:, block].zero_()

    def verify_full(rep: int) -> None:
        triton_exec.dirty_flags(spec, plans[rep])

    add("triton", device_us(triton_zero, reps), wall_us(evidence_call, min(reps, 20)))
    add("index_fill_/layer", device_us(index_fill, reps), wall_us(index_fill, min(reps, 10)))
    if count <= 256:  # 2048 blocks would take 65k-160k launches per call
        loop_reps = 3 if count > 16 else reps
        add("loop/block+layer", device_us(per_block, loop_reps), wall_us(per_block, 3))
    add("verify full (read)", device_us(verify_full, reps))
    return rows


def sweep(spec: KVCacheSpec, reps: int) -> list[dict[str, float]]:
    """Device time of the zero and verify kernels per tuning, on the 8B shape."""
    cases = {count: [sorted(ids) for ids in id_sets(count, reps)] for count in (1, 256, 2048)}
    grid = [
        Tuning(tile_bytes=tile, programs_per_sm=per_sm, num_warps=warps)
        for tile in (4096, 8192, 16384, 32768)
        for per_sm in (2, 4, 8, 16)
        for warps in (4, 8)
    ]
    return [sweep_one(spec, tuning, cases, reps) for tuning in grid]


def sweep_one(
    spec: KVCacheSpec, tuning: Tuning, cases: dict[int, list[list[int]]], reps: int
) -> dict[str, float]:
    entry: dict[str, float] = dict(vars(tuning))
    for count, plans in cases.items():

        def zero(rep: int, plans: list[list[int]] = plans) -> None:
            triton_exec.zero_blocks(spec, plans[rep], tuning)

        def read(rep: int, plans: list[list[int]] = plans) -> None:
            triton_exec.dirty_flags(spec, plans[rep], tuning)

        entry[f"zero_{count}"] = device_us(zero, reps)
        entry[f"read_{count}"] = device_us(read, reps)
    return entry


def host_costs(spec: KVCacheSpec, reps: int) -> list[dict[str, object]]:
    """Host time per call on the 8B cache, per block count and verification mode (module docstring)."""
    rows: list[dict[str, object]] = []
    for count in HOST_COUNTS:
        sets = id_sets(count, reps)
        for mode in ("none", "sample", "full"):
            zeroize(spec, plan_zeroize(sets[-1], NUM_BLOCKS), verify=mode)  # compile, staging
            samples: dict[str, list[float]] = {
                k: [] for k in ("plan", "enqueue", "collect", "sync")
            }
            device: dict[str, list[float]] = {"clear": [], "verify": []}
            for rep in range(reps):
                started = time.perf_counter()
                planned = plan_zeroize(sets[rep], NUM_BLOCKS)
                middle = time.perf_counter()
                pending = zeroize_async(spec, planned, verify=mode)
                enqueued = time.perf_counter()
                torch.cuda.synchronize()
                ready = time.perf_counter()
                assert pending.poll()
                evidence = pending.evidence()
                collected = time.perf_counter()
                samples["plan"].append(middle - started)
                samples["enqueue"].append(enqueued - middle)
                samples["collect"].append(collected - ready)
                device["clear"].append(evidence.device_time_us or 0.0)
                device["verify"].append(evidence.verify_time_us or 0.0)
                torch.cuda.synchronize()
                started = time.perf_counter()
                zeroize(spec, planned, verify=mode)
                samples["sync"].append(time.perf_counter() - started)
            row: dict[str, object] = {"blocks": count, "verify": mode}
            row.update({f"{k}_us": statistics.median(v) * 1e6 for k, v in samples.items()})
            row.update({f"{k}_device_us": statistics.median(v) for k, v in device.items()})
            rows.append(row)
            print("host", json.dumps(row), flush=True)
    return rows


def back_to_back(spec: KVCacheSpec, reps: int = 100) -> list[dict[str, object]]:
    """Host time of `zeroize_async` in a loop of calls with no synchronization between them (as an
    engine enqueues step after step), plans made beforehand; the stagings pool is warmed first."""
    rows: list[dict[str, object]] = []
    for count in (1, 16, 64):
        plans = [plan_zeroize(ids, NUM_BLOCKS) for ids in id_sets(count, reps)]
        for mode in ("none", "sample", "full"):
            times: list[float] = []
            for _pass in range(2):  # the first pass fills the pool with `reps` stagings
                times, pendings = [], []
                for planned in plans:
                    started = time.perf_counter()
                    pendings.append(zeroize_async(spec, planned, verify=mode))
                    times.append(time.perf_counter() - started)
                torch.cuda.synchronize()
                assert all(p.poll() and p.ok for p in pendings)
            row: dict[str, object] = {"blocks": count, "verify": mode}
            row["enqueue_us"] = statistics.median(times) * 1e6
            row["enqueue_best_us"] = min(times) * 1e6
            rows.append(row)
            print("b2b", json.dumps(row), flush=True)
    return rows


def queued_calls(spec: KVCacheSpec, reps: int = 5) -> dict[str, float]:
    """Host time of a one-block call behind ~40 ms of queued GPU work: async vs sync (medians)."""
    one = plan_zeroize([7], NUM_BLOCKS)
    times: dict[str, list[float]] = {"async_us": [], "sync_us": []}
    for _ in range(reps):
        for name, call in (("async_us", zeroize_async), ("sync_us", zeroize)):
            torch.cuda.synchronize()
            torch.cuda._sleep(QUEUE_CYCLES)  # type: ignore[no-untyped-call]
            started = time.perf_counter()
            call(spec, one, verify="sample")
            times[name].append((time.perf_counter() - started) * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in times.items()}


def breakdown(spec: KVCacheSpec, reps: int = 200) -> dict[str, float]:
    """Median host time of each piece of the GPU enqueue path (64 blocks), and of the torch calls
    the path avoids, to see where the time goes."""
    launch = triton_exec.launcher(spec)
    ids = sorted(id_sets(64, 1)[0])
    stream = torch.cuda.current_stream()
    handle = launch.stream_handle(None)
    staging = launch.staging.take(64)
    event = staging.events[0]
    pieces: dict[str, Callable[[], object]] = {
        "plan_zeroize(64)": lambda: plan_zeroize(ids, NUM_BLOCKS),
        "stream handle": lambda: launch.stream_handle(None),
        "ids -> pinned": lambda: staging.ids_view.__setitem__(slice(0, 64), array.array("q", ids)),
        "upload": lambda: staging.upload(64, None, handle),
        "event record": lambda: staging.record(0, None, handle),
        "clear launch": lambda: launch.clear(staging.device_ids_address, 64, handle=handle),
        "check launch": lambda: launch.check(
            staging.device_ids_address, 64, staging.flags_address, handle=handle
        ),
        "torch: current_stream()": torch.cuda.current_stream,
        "torch: copy_ 512 B": lambda: staging.device_ids[:64].copy_(
            staging.host_ids[:64], non_blocking=True
        ),
        "torch: Event.record": lambda: event.record(stream),
    }
    out: dict[str, float] = {}
    for name, piece in pieces.items():
        piece()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            piece()
            times.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        out[name] = statistics.median(times) * 1e6
    launch.staging.give(staging)
    return out


def plan_cost_us(reps: int = 50) -> dict[str, dict[str, dict[str, float]]]:
    """Host time of the planner, best and median of `reps`, for the C extension and the pure-Python
    path in the same run (alternating): 10,000 scattered ids of 100,000, alone and with the runs
    coalesced, and 64 of those ids. The "c" entry is missing when the extension is not built."""
    ids = random.Random(4).sample(range(100_000), 10_000)
    paths: dict[str, tuple[Callable[..., tuple[int, ...]], Callable[..., object]]] = {
        "python": (plan._canonical_ids_python, plan._coalesce_python)
    }
    if plan.native_planner_available():
        paths["c"] = (plan._canonical_ids, plan._coalesce)
    samples: dict[str, dict[str, list[float]]] = {
        path: {"plan": [], "plan_and_runs": [], "plan_64_ids": []} for path in paths
    }
    for _ in range(reps):
        for path, (canonical, coalesce) in paths.items():
            started = time.perf_counter()
            planned = plan.ZeroizePlan(100_000, canonical(ids, 100_000))  # as plan_zeroize does
            middle = time.perf_counter()
            coalesce(planned.block_ids)  # as ZeroizePlan.runs does
            done = time.perf_counter()
            plan.ZeroizePlan(100_000, canonical(ids[:64], 100_000))
            small = time.perf_counter()
            times = samples[path]
            times["plan"].append((middle - started) * 1e6)
            times["plan_and_runs"].append((done - started) * 1e6)
            times["plan_64_ids"].append((small - done) * 1e6)
    return {
        path: {
            case: {"best": min(values), "median": statistics.median(values)}
            for case, values in cases.items()
        }
        for path, cases in samples.items()
    }


def print_plan_cost(cost: dict[str, dict[str, dict[str, float]]]) -> None:
    for path, cases in cost.items():
        print(f"plan ({path:6}, host CPU) best / median us: "
              + ", ".join(f"{case} {v['best']:.0f} / {v['median']:.0f}" for case, v in cases.items()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--plan-only", action="store_true", help="only the host-side planner (no GPU)"
    )
    parser.add_argument("--host-only", action="store_true", help="only the host-cost tables")
    args = parser.parse_args()
    if args.plan_only:
        print("env", json.dumps({"python": platform.python_version(), "cpu": platform.processor()}))
        print_plan_cost(plan_cost_us())
        return
    props = torch.cuda.get_device_properties(0)
    env = {
        "device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "tuning": vars(triton_exec.DEFAULT_TUNING), "verify_tuning": vars(triton_exec.DEFAULT_VERIFY_TUNING),
    }  # fmt: skip
    print("env", json.dumps(env), flush=True)
    report: dict[str, object] = {"env": env}
    host_spec = make_cache(SHAPES["llama3-8b"])
    report["host"] = host_costs(host_spec, max(args.reps, 50))
    report["back_to_back"] = back_to_back(host_spec)
    report["queued"] = queued_calls(host_spec)
    report["breakdown"] = breakdown(host_spec)
    del host_spec
    torch.cuda.empty_cache()
    if args.host_only:
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
        print_host(report)
        return
    report["plan_10k_ids_us"] = plan_cost_us()
    report["ceilings"] = ceilings(args.reps)
    print("ceilings", json.dumps(report["ceilings"]), flush=True)
    rows: list[Row] = []
    for name, layers in SHAPES.items():
        spec = make_cache(layers)
        if args.sweep and name == "llama3-8b":
            results = sweep(spec, max(10, args.reps // 2))
            report["sweep"] = results
            for entry in results:
                print("sweep", json.dumps(entry), flush=True)
        rows += bench_shape(name, spec, args.reps)
        del spec
        torch.cuda.empty_cache()
    report["rows"] = [vars(r) for r in rows]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    print_table(report, rows)


def print_host(report: dict[str, object]) -> None:
    rows = report["host"]
    assert isinstance(rows, list)
    print()
    print(f"host cost per call (8B cache), medians: {'blocks':>6} {'verify':6} {'plan':>6} "
          f"{'enqueue':>8} {'collect':>8} {'sync':>8} {'dev clear':>9} {'dev verify':>10}")  # fmt: skip
    for r in rows:
        print(f"{'':40} {r['blocks']:6d} {r['verify']:6} {r['plan_us']:6.1f} {r['enqueue_us']:8.1f} "
              f"{r['collect_us']:8.1f} {r['sync_us']:8.1f} {r['clear_device_us']:9.1f} "
              f"{r['verify_device_us']:10.1f}")  # fmt: skip
    b2b = report["back_to_back"]
    assert isinstance(b2b, list)
    print("back-to-back enqueue (median / best us):",
          ", ".join(f"{r['blocks']} {r['verify']} {r['enqueue_us']:.1f}/{r['enqueue_best_us']:.1f}"
                    for r in b2b))  # fmt: skip
    print("behind ~40 ms of queued work, 1 block, us:", json.dumps(report["queued"]))
    print(
        "enqueue path pieces, us:",
        json.dumps({k: round(v, 2) for k, v in report["breakdown"].items()}),
    )  # type: ignore[union-attr]


def print_table(report: dict[str, object], rows: list[Row]) -> None:
    ceil = report["ceilings"]
    assert isinstance(ceil, dict)
    cost = report["plan_10k_ids_us"]
    assert isinstance(cost, dict)
    print_host(report)
    print()
    print_plan_cost(cost)
    print(f"ceilings: zero_ {ceil['zero_tb_s']:.2f} TB/s, read (amax) {ceil['read_tb_s']:.2f} TB/s, "
          f"copy {ceil['copy_tb_s']:.2f} TB/s")  # fmt: skip
    print(f"{'shape':11} {'method':20} {'blocks':>6} {'dev us':>10} {'TB/s':>6} {'%ceil':>6} "
          f"{'wall us':>10}")  # fmt: skip
    for r in rows:
        base = ceil["read_tb_s"] if r.method.startswith("verify") else ceil["zero_tb_s"]
        wall = f"{r.wall_us:10.1f}" if r.wall_us is not None else " " * 10
        print(f"{r.shape:11} {r.method:20} {r.blocks:6d} {r.device_us:10.1f} {r.tb_s:6.2f} "
              f"{100 * r.tb_s / base:5.1f}% {wall}")  # fmt: skip


if __name__ == "__main__":
    main()
