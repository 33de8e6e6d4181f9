"""Zeroization benchmark (issue 4, item 7; issue 14, item 2): the one-launch Triton kernel against its
ceilings and the naive alternatives, on Llama-3-8B and 70B KV cache shapes, and the host cost of one
call. Needs a CUDA GPU.

    PYTHONPATH=. python benchmarks/zeroize_bench.py [--sweep] [--json PATH]
    PYTHONPATH=. python benchmarks/zeroize_bench.py --host-only   # only the host-cost tables
    PYTHONPATH=. python benchmarks/zeroize_bench.py --plan-only   # the host-side planner, any machine

Host cost (8B shape). "enqueue" is the host time of `zeroize_async(cache, plan, verify=mode)`: what
an engine's step pays (issue 14 target: <= 30 us up to 64 blocks), each call right after a
`torch.cuda.synchronize()`; "untimed" the same with `timed=False` (no device timings in the
evidence); "plan" is `plan_zeroize` before it; "collect" is `poll()` + `evidence()` once the device
has finished (paid at a later step); "sync" is the whole synchronous `zeroize()` with the GPU idle.
The matrix repeats the enqueue after a sync ("single") and with no synchronization between calls
("loop", as an engine does step after step), timed and untimed, on the default and a side stream. "queued" repeats one-block calls behind ~40 ms of queued GPU work: `zeroize_async` returns at
once, `zeroize` waits for the queue. "pieces" times each part of the path; "in place" compares the
device time of a call whose kernels read the ids from pinned host memory with one that copies them
first. Medians.

Timing. "Device time" is CUDA-event time with the host kept ahead of the GPU: each repetition first
enqueues a ~2 ms spin kernel, so the events bracket only device work, never Python or launch gaps
(those are reported separately as "wall", host-synchronised per call). Medians of `--reps` runs.
Block ids are drawn at random (scattered, as real releases are), fresh for every repetition.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import secrets
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
import triton

from kvguard.zeroize import (
    KVCacheSpec,
    PendingZeroize,
    ZeroizePlan,
    callgraph,
    plan,
    plan_zeroize,
    triton_exec,
    zeroize,
    zeroize_async,
)
from kvguard.zeroize import staging as staging_mod
from kvguard.zeroize.triton_exec import Tuning
from kvguard.zeroize.verify import sample_blocks

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
    """Host time per call on the 8B cache, per block count and verification mode (module docstring).
    Each enqueue follows a `torch.cuda.synchronize()`: a single call with the GPU idle."""
    rows: list[dict[str, object]] = []
    for count in HOST_COUNTS:
        sets = id_sets(count, reps)
        for mode in ("none", "sample", "full"):
            zeroize(spec, plan_zeroize(sets[-1], NUM_BLOCKS), verify=mode)  # compile, staging
            samples: dict[str, list[float]] = {
                k: [] for k in ("plan", "enqueue", "enqueue_untimed", "collect", "sync")
            }
            device: dict[str, list[float]] = {"clear": [], "verify": []}
            for rep in range(reps):
                started = time.perf_counter()
                planned = plan_zeroize(sets[rep], NUM_BLOCKS)
                middle = time.perf_counter()
                pending = zeroize_async(spec, planned, verify=mode, timed=True)
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
                untimed = zeroize_async(spec, planned, verify=mode, timed=False)
                samples["enqueue_untimed"].append(time.perf_counter() - started)
                torch.cuda.synchronize()
                assert untimed.poll() and untimed.ok and untimed.evidence().device_time_us is None
                started = time.perf_counter()
                zeroize(spec, planned, verify=mode)
                samples["sync"].append(time.perf_counter() - started)
            row: dict[str, object] = {"blocks": count, "verify": mode}
            row.update({f"{k}_us": statistics.median(v) * 1e6 for k, v in samples.items()})
            row.update({f"{k}_device_us": statistics.median(v) for k, v in device.items()})
            rows.append(row)
            print("host", json.dumps(row), flush=True)
    return rows


def enqueue_matrix(spec: KVCacheSpec, reps: int = 100) -> list[dict[str, object]]:
    """Host time of `zeroize_async` at 1, 16 and 64 blocks, per verification mode, timed and untimed,
    on torch's default stream (the legacy stream, what an engine that sets no stream uses) and on a
    side stream: "single" is a call right after `torch.cuda.synchronize()`; "loop" a call in a loop
    with no synchronization between calls (as an engine enqueues step after step). Plans are made
    beforehand; the stagings (and their graphs) are made by a first, untimed pass."""
    rows: list[dict[str, object]] = []
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for stream_name, stream in (("default", None), ("side", side)):
        for count in (1, 16, 64):
            plans = [plan_zeroize(ids, NUM_BLOCKS) for ids in id_sets(count, reps)]
            for mode in ("none", "sample", "full"):
                row: dict[str, object] = {"stream": stream_name, "blocks": count, "verify": mode}
                for timed in (True, False):
                    suffix = "" if timed else "_untimed"
                    for _pass in range(2):  # the first pass fills the pool with `reps` stagings
                        loop, pendings = [], []
                        for planned in plans:
                            started = time.perf_counter()
                            pending = zeroize_async(spec, planned, stream=stream, verify=mode,
                                                    timed=timed)  # fmt: skip
                            loop.append(time.perf_counter() - started)
                            pendings.append(pending)
                        torch.cuda.synchronize()
                        assert all(p.poll() and p.ok for p in pendings)
                    single = []
                    for planned in plans[: reps // 2]:
                        torch.cuda.synchronize()
                        started = time.perf_counter()
                        pending = zeroize_async(spec, planned, stream=stream, verify=mode,
                                                timed=timed)  # fmt: skip
                        single.append(time.perf_counter() - started)
                        torch.cuda.synchronize()
                        assert pending.poll() and pending.ok
                    row[f"loop{suffix}_us"] = statistics.median(loop) * 1e6
                    row[f"single{suffix}_us"] = statistics.median(single) * 1e6
                rows.append(row)
                print("matrix", json.dumps(row), flush=True)
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
    """Median host time of each piece of the GPU enqueue path (64 blocks), and of the calls the
    path avoids (kernel launches one by one, torch's copy and record, the Python ways of drawing
    the sample and packing the ids, "(before)"), to see where the time goes. The graph pieces
    include the call's completion and timing records (callgraph.py).
    Each piece runs `reps` times in a loop, then once per rep right after a
    `torch.cuda.synchronize()` ("after sync")."""
    launch = triton_exec.launcher(spec)
    planned = plan_zeroize(id_sets(64, 1)[0], NUM_BLOCKS)
    ids = planned.block_ids
    stream = torch.cuda.current_stream()
    handle = launch.stream_handle(None)
    staging = launch.staging.take(64)
    uploading = staging_mod.Staging(spec.device, 128)  # host_ids_max 0: ids copied to the device
    event = staging.events[0]
    address, flags = staging.ids_address, staging.flags_address
    counts = iter(range(1 << 30))
    sampler = random.Random(secrets.randbits(256))  # as verify's unseeded generator

    def graph(timed: bool, check: bool, changing: bool) -> None:
        n = 64 - next(counts) % 2 if changing else 64  # 64, 63, 64...: every node updated
        callgraph.enqueue(launch, staging, n, 0, n if check else 0, handle, timed=timed)

    pieces: dict[str, Callable[[], object]] = {
        "plan_zeroize(64)": lambda: plan_zeroize(ids, NUM_BLOCKS),
        "stream handle": lambda: launch.stream_handle(None),
        "ids -> pinned": lambda: staging.write_ids(ids),
        "ids -> pinned, struct.pack_into (before)": lambda: struct.pack_into(
            f"{len(ids)}q", staging.ids_bytes, 0, *ids
        ),
        "sample 8 of 64": lambda: sample_blocks(planned, 8, None),
        "sample 8 of 64, random.sample (before)": lambda: sorted(sampler.sample(ids, 8)),
        "clock: datetime.now(UTC) (before)": lambda: datetime.now(UTC),
        "graph clear+check, timed": lambda: graph(True, True, False),
        "graph clear+check, timed, counts changing": lambda: graph(True, True, True),
        "graph clear+check, untimed": lambda: graph(False, True, False),
        "graph clear, untimed": lambda: graph(False, False, False),
        "completion record (no timing)": lambda: staging.record(staging_mod.DONE, None, handle),
        "event record (timing)": lambda: staging.record(0, None, handle),
        "upload (driver copy)": lambda: uploading.upload(64, None, handle),
        "clear launch (Triton)": lambda: launch.clear(address, 64, handle=handle),
        "check launch (Triton)": lambda: launch.check(address, 64, flags, handle=handle),
        "torch: current_stream()": torch.cuda.current_stream,
        "torch: copy_ 512 B": lambda: uploading.device_ids[:64].copy_(
            uploading.host_ids[:64], non_blocking=True
        ),
        "torch: Event.record": lambda: event.record(stream),
    }
    out: dict[str, float] = {}
    for name, piece in pieces.items():
        piece()
        times, cold = [], []
        for _ in range(reps):
            started = time.perf_counter()
            piece()
            times.append(time.perf_counter() - started)
        for _ in range(min(reps, 50)):
            torch.cuda.synchronize()
            started = time.perf_counter()
            piece()
            cold.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        out[name] = statistics.median(times) * 1e6
        out[name + ", after sync"] = statistics.median(cold) * 1e6
    torch.cuda.synchronize()
    launch.staging.give(staging)
    return out


def ids_in_place(spec: KVCacheSpec, reps: int) -> list[dict[str, object]]:
    """Device time of a whole call (spin-ahead CUDA events around `zeroize_async`, untimed) with the
    ids read by the kernels from pinned host memory, against the same call with the ids copied to
    the device first (the copy is the graph's first node), per block count, verify none and full:
    what reading the ids in place costs the GPU. Each pool is warmed first (stagings and graphs
    made outside the timing)."""
    launch = triton_exec.launcher(spec)
    kept = launch.staging
    rows: list[dict[str, object]] = []
    try:
        for count in (1, 16, 64, 256, 2048):
            plans = [plan_zeroize(ids, NUM_BLOCKS) for ids in id_sets(count, reps)]
            for mode in ("none", "full"):
                row: dict[str, object] = {"blocks": count, "verify": mode}
                for name, most in (("in_place_us", 1 << 30), ("copied_us", 0)):
                    launch.staging = staging_mod.StagingPool(spec.device, host_ids_max=most)
                    warm = [zeroize_async(spec, p, verify=mode, timed=False) for p in plans]
                    torch.cuda.synchronize()
                    assert all(p.poll() and p.ok for p in warm)
                    pendings: list[PendingZeroize] = []

                    def call(
                        rep: int, plans: list[ZeroizePlan] = plans, mode: str = mode,
                        pendings: list[PendingZeroize] = pendings,
                    ) -> None:  # fmt: skip
                        pendings.append(zeroize_async(spec, plans[rep], verify=mode, timed=False))

                    row[name] = device_us(call, reps)
                    assert all(p.poll() and p.ok for p in pendings)
                rows.append(row)
                print("in_place", json.dumps(row), flush=True)
    finally:
        launch.staging = kept
    return rows


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
    report["matrix"] = enqueue_matrix(host_spec)
    report["queued"] = queued_calls(host_spec)
    report["breakdown"] = breakdown(host_spec)
    report["in_place"] = ids_in_place(host_spec, max(args.reps, 30))
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
          f"{'enqueue':>8} {'untimed':>8} {'collect':>8} {'sync':>8} {'dev clear':>9} "
          f"{'dev verify':>10}")  # fmt: skip
    for r in rows:
        print(f"{'':40} {r['blocks']:6d} {r['verify']:6} {r['plan_us']:6.1f} {r['enqueue_us']:8.1f} "
              f"{r['enqueue_untimed_us']:8.1f} {r['collect_us']:8.1f} {r['sync_us']:8.1f} "
              f"{r['clear_device_us']:9.1f} {r['verify_device_us']:10.1f}")  # fmt: skip
    matrix = report["matrix"]
    assert isinstance(matrix, list)
    print(
        "enqueue us, medians (single: after a sync; loop: no sync between calls), timed | untimed:"
    )
    for r in matrix:
        print(f"  {r['stream']:7} {r['blocks']:3d} {r['verify']:6} single {r['single_us']:6.1f} "
              f"loop {r['loop_us']:6.1f} | single {r['single_untimed_us']:6.1f} "
              f"loop {r['loop_untimed_us']:6.1f}")  # fmt: skip
    print("behind ~40 ms of queued work, 1 block, us:", json.dumps(report["queued"]))
    pieces = report["breakdown"]
    assert isinstance(pieces, dict)
    print("enqueue path pieces, us:", json.dumps({k: round(v, 2) for k, v in pieces.items()}))
    in_place = report["in_place"]
    assert isinstance(in_place, list)
    for r in in_place:
        print(f"device us per call, ids read in place vs copied: {r['blocks']:4d} {r['verify']:5} "
              f"{r['in_place_us']:7.1f} {r['copied_us']:7.1f}")  # fmt: skip


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
