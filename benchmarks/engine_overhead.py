"""Governed vs plain vLLM on the same workload: tokens/s ratio and kvguard's per-step cost.

Each engine runs in its own child process (vLLM keeps process-global state); the parent alternates
plain and governed runs (plain, governed, plain, governed, ...) so drift on the shared machine hits
both alike, and reports the ratio of the medians. Plain vLLM gets the same per-tenant salts as
client-supplied `cache_salt` values, so both engines see the same cache hits: the difference is
kvguard's own work (custody, policy, ledger, zeroization), not the isolation it enforces.

Target (issues 5 and 10): governed/plain >= 0.95 on the tiny CPU model, the worst case, where per-step
Python overhead dominates, also with the KV pool full and the engine evicting (`--kv-kib 1024
--tenants 16`: 64 blocks for 16 tenants' distinct prefixes, so every batch evicts cached blocks).
Run: .venv/bin/python benchmarks/engine_overhead.py [--rounds 3] [--batches 3] [--kv-kib N]
     [--tenants T] [--ledger-interval S] [--writer-nice N] [--floor] [--phases]

`--floor` adds a third engine to each round: plain vLLM with a connector that does nothing
(`benchmarks/noop_connector.py`), so the report also says what vLLM's own connector plumbing costs
(connector/plain), the ceiling of governed/plain on the workload.

Each child runs a warm-up batch, then `--batches` measured batches; the ratio compares the medians
over every measured batch of each engine. Besides tokens/s it reports, per engine, where the wall
time went: vLLM's forward passes (`GPUModelRunner._model_forward`, timed around each call) and the
rest of the step loop (scheduling, sampling, and for the governed engine kvguard's own work), the
scheduler's counts (steps, scheduled tokens, preemptions: equal counts mean equal forward work), CPU
seconds per thread, Python's cyclic collections, and for the governed engine the ledger writer's
group commits and how much longer the forward passes that overlapped one took (on two cores the
writer's CPU comes out of vLLM's OpenMP forward threads).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
TENANTS = 8
PER_TENANT = 12
MAX_TOKENS = 32


def workload(tenants: int = TENANTS) -> list[tuple[str, list[int]]]:
    """Tenants with a shared 2-block system prompt each plus distinct questions (same-scope reuse)."""
    items = []
    for r in range(PER_TENANT):
        for t in range(tenants):
            system = [(t * 53 + 11 * i) % 500 + 5 for i in range(2 * BLOCK)]
            question = [(r * 29 + t * 7 + 3 * i) % 500 + 5 for i in range(20)]
            items.append((f"tenant-{t}", system + question))
    return items


def engine_kwargs(kv_bytes: int = 8 << 20) -> dict[str, object]:
    return {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": BLOCK,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": 512,
        "max_num_seqs": 16,
        "seed": 0,
        "disable_log_stats": False,
    }


def open_engine(
    mode: str,
    items: list[tuple[str, list[int]]],
    params: Any,
    kwargs: dict[str, object],
    *,
    ledger_interval: float | None = None,
    writer_nice: int | None = None,
) -> tuple[Callable[[], list], Any]:
    """A plain vLLM engine (per-tenant client salts) or a governed one (kvguard's), in this process,
    and a function running `items` through it in one batch; the second value is the `GuardedLLM`
    (None for plain). Shared by the benchmarks that compare the two on one workload."""
    from kvguard.engine_adapter.vllm.guarded import TenantRequest, tiny_llama_dir  # noqa: PLC0415

    if mode in ("plain", "connector"):
        from vllm import LLM  # noqa: PLC0415
        from vllm.config import KVTransferConfig  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        if mode == "connector":  # vLLM's connector path, nothing of kvguard's
            noop = KVTransferConfig(
                kv_connector="NoopConnector",
                kv_connector_module_path="benchmarks.noop_connector",
                kv_role="kv_both",
            )
            kwargs = {**kwargs, "kv_transfer_config": noop}
        llm = LLM(model=str(tiny_llama_dir()), enable_prefix_caching=True, **kwargs)
        prompts = [TokensPrompt(prompt_token_ids=p, cache_salt=t) for t, p in items]
        return lambda: llm.generate(prompts, params, use_tqdm=False), None
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import write_secrets  # noqa: PLC0415

    extra: dict[str, Any] = {"verify_override": "sample"}
    if ledger_interval is not None:
        extra["ledger_commit_interval_s"] = ledger_interval
    if writer_nice is not None:
        extra["ledger_writer_nice"] = writer_nice
    opts = GuardOptions(**write_secrets(Path(tempfile.mkdtemp())), **extra)
    g = GuardedLLM(str(tiny_llama_dir()), options=opts, **kwargs)
    batch = [(TenantRequest(t), p) for t, p in items]
    return lambda: g.generate_batch(batch, params), g


def child(mode: str, out: Path, args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    steps = StepTimes()
    run, g = open_engine(
        mode,
        workload(args.tenants),
        params,
        engine_kwargs(args.kv_kib << 10),
        ledger_interval=args.ledger_interval,
        writer_nice=args.writer_nice,
    )
    commits = CommitTimes(g.connector.scheduler_guard.ledger) if g is not None else None
    phases = PhaseClock.around(g) if g is not None and args.phases else None
    run()  # warm-up (also fills the cache so measured runs see the same hits)
    batches = []
    for _ in range(args.batches):
        before = phases.snapshot() if phases is not None else {}
        first_step = g.connector.scheduler_guard.steps if g is not None else 0
        evicted = g.connector.scheduler_guard.reporter.counts["evictions"] if g is not None else 0
        cpu_before = thread_cpu()
        steps.clear()
        if commits is not None:
            commits.clear()
        gc_time = GcTimer()
        start = time.perf_counter()
        outs = run()
        wall = time.perf_counter() - start
        gc_time.stop()
        result: dict[str, Any] = {
            "wall_s": wall,
            "generated": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "prefill_avoided": sum(o.num_cached_tokens for o in outs),
            "scheduled": dict(steps.counts),
            "forward_s": sum(d for _, d in steps.forwards),
            "gc": gc_time.totals,
            "thread_cpu_s": _delta(thread_cpu(), cpu_before),
        }
        if commits is not None:
            result["commits"] = commits.overlap(steps.forwards)
        if phases is not None:
            after = phases.snapshot()
            result["phases"] = {
                k: {
                    "seconds": v["seconds"] - before.get(k, {}).get("seconds", 0.0),
                    "calls": v["calls"] - before.get(k, {}).get("calls", 0),
                }
                for k, v in after.items()
            }
        if g is not None:
            result["steps"] = g.connector.scheduler_guard.steps - first_step
            result["evictions"] = g.connector.scheduler_guard.reporter.counts["evictions"] - evicted
        batches.append(result)
    if g is not None:
        g.close()
    out.write_text(json.dumps(batches))


class StepTimes:
    """vLLM's scheduler steps, the tokens they schedule (prefill recomputed after a preemption
    included) and its preemptions, from `Scheduler.schedule`'s output (the same counts for plain
    and governed engines mean the same forward work), and each forward pass's start and duration."""

    def __init__(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: PLC0415

        self.counts: Counter[str] = Counter()
        self.forwards: list[tuple[float, float]] = []
        schedule, forward = Scheduler.schedule, GPUModelRunner._model_forward
        counts, forwards = self.counts, self.forwards

        def timed_schedule(sched: Any, *a: Any, **kw: Any) -> Any:
            out = schedule(sched, *a, **kw)
            counts["steps"] += 1
            counts["tokens"] += out.total_num_scheduled_tokens
            counts["preempted"] += len(out.preempted_req_ids or ())
            return out

        def timed_forward(runner: Any, *a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = forward(runner, *a, **kw)
            forwards.append((t, time.perf_counter() - t))
            return out

        Scheduler.schedule = timed_schedule  # type: ignore[method-assign]
        GPUModelRunner._model_forward = timed_forward  # type: ignore[method-assign]

    def clear(self) -> None:
        self.counts.clear()
        self.forwards.clear()


class CommitTimes:
    """The governed engine's ledger group commits (start, duration), timed around the writer's
    write function, and the forward passes they overlapped."""

    def __init__(self, ledger: Any) -> None:
        writer = ledger._writer  # a benchmark may look inside: nothing is changed but timing
        write, commits = writer._write, []
        self.commits: list[tuple[float, float]] = commits

        def timed(batch: Any) -> None:
            t = time.perf_counter()
            write(batch)
            commits.append((t, time.perf_counter() - t))

        writer._write = timed

    def clear(self) -> None:
        self.commits.clear()

    def overlap(self, forwards: list[tuple[float, float]]) -> dict[str, float]:
        commits = list(self.commits)
        hit, clear = [], []
        for start, dur in forwards:
            overlaps = any(c < start + dur and c + cd > start for c, cd in commits)
            (hit if overlaps else clear).append(dur)
        return {
            "count": len(commits),
            "seconds": sum(d for _, d in commits),
            "forwards_overlapped": len(hit),
            "overlapped_mean_s": statistics.fmean(hit) if hit else 0.0,
            "clear_mean_s": statistics.fmean(clear) if clear else 0.0,
        }


class GcTimer:
    """Wall time and count of Python's cyclic collections per generation while it is installed:
    allocations by either side trigger collections that walk the engine's whole object graph."""

    def __init__(self) -> None:
        self._start = 0.0
        self.totals: dict[str, list[float]] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        entry = self.totals.setdefault(f"gen{info['generation']}", [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - self._start

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, by thread name (Python's names where it knows the
    thread, the kernel's `comm` otherwise: vLLM's OpenMP workers show as `python`), summed per
    name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd on; utime, stime
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        name = names.get(int(task.name), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v > before.get(k, 0.0)}


class PhaseClock:
    """kvguard's phases timed from the outside: wall time and calls per phase, from wrappers put
    around the connector methods vLLM calls (the engine itself carries no timers)."""

    # (scheduler connector method, phase); the worker side's and the ledger's are added in `around`
    SCHEDULER = (
        ("on_new_request", "on_new_request"),
        ("get_num_new_matched_tokens", "admission_gate"),
        ("update_state_after_alloc", "update_state_after_alloc"),
        ("build_connector_meta", "build_step"),
        ("request_finished", "request_finished"),
        ("update_connector_output", "worker_output"),
    )

    def __init__(self, *, cpu: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}  # the calling thread's CPU time (`cpu`)
        self.calls: dict[str, int] = {}
        self.cpu = cpu

    @classmethod
    def around(cls, g: Any) -> PhaseClock:
        from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

        clock = cls()
        for method, phase in cls.SCHEDULER:
            clock.wrap(g.connector, method, phase)
        clock.wrap(g.connector.scheduler_guard.bridge, "submit", "ledger_submit")  # nested
        worker = get_kv_transfer_group()  # in-process: the worker's own connector
        clock.wrap(worker, "bind_connector_metadata", "worker_zeroize")
        clock.wrap(worker, "start_load_kv", "tier_load")
        return clock

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        """Time `method` of `obj` (a class: every instance's calls; an instance: its own)."""
        orig = getattr(obj, method)
        self.seconds[phase], self.cpu_seconds[phase], self.calls[phase] = 0.0, 0.0, 0
        cpu = self.cpu

        def timed(*args: Any, **kwargs: Any) -> Any:
            # The CPU clock (a system call, about 0.6 us) outside the wall clock's window, so the
            # wall time of each call does not hold one of its reads.
            cpu_start = time.thread_time() if cpu else 0.0
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                if cpu:
                    self.cpu_seconds[phase] += time.thread_time() - cpu_start
                self.calls[phase] += 1

        setattr(obj, method, timed)

    def reset(self) -> None:
        for table in (self.seconds, self.cpu_seconds):
            table.update(dict.fromkeys(table, 0.0))
        self.calls.update(dict.fromkeys(self.calls, 0))

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {p: {"seconds": self.seconds[p], "calls": self.calls[p]} for p in self.seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["plain", "connector", "governed"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=3, help="measured batches per child")
    ap.add_argument("--kv-kib", type=int, default=8192, help="KV pool size (KiB)")
    ap.add_argument("--tenants", type=int, default=TENANTS)
    ap.add_argument(
        "--ledger-interval", type=float, help="governed: ledger_commit_interval_s (default 0.05)"
    )
    ap.add_argument(
        "--writer-nice",
        type=int,
        help="governed: ledger_writer_nice (default 0; try 19 on a CPU host not oversubscribed)",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="governed: time kvguard's phases from the outside (wrappers around the connector's "
        "methods; they add their own cost to the governed engine, so ratios are read without)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also run plain vLLM with a connector that does nothing (vLLM's connector cost)",
    )
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out, args)
        return
    modes = ("plain", "connector", "governed") if args.floor else ("plain", "governed")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    passthrough = ["--batches", str(args.batches), "--kv-kib", str(args.kv_kib)]
    passthrough += ["--tenants", str(args.tenants)]
    if args.ledger_interval is not None:
        passthrough += ["--ledger-interval", str(args.ledger_interval)]
    if args.writer_nice is not None:
        passthrough += ["--writer-nice", str(args.writer_nice)]
    if args.phases:
        passthrough.append("--phases")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in modes:
                out = Path(tmp) / f"{mode}-{r}.json"
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                cmd = [sys.executable, __file__, "--child", mode, "--out", str(out), *passthrough]
                subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
                batches = json.loads(out.read_text())
                runs[mode].extend(batches)
                rates = [round(b["generated"] / b["wall_s"], 1) for b in batches]
                print(f"round {r} {mode:<9} generated tok/s per batch {rates}", file=sys.stderr)
    report(args, runs)


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    med = statistics.median
    rates = {m: [x["generated"] / x["wall_s"] for x in v] for m, v in runs.items()}
    plain, governed = med(rates["plain"]), med(rates["governed"])
    last = runs["governed"][-1]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )
    print(
        f"workload: {args.tenants} tenants x {PER_TENANT} requests, 84-token prompts, "
        f"{MAX_TOKENS} tokens out, KV pool {args.kv_kib} KiB; {args.rounds} rounds x "
        f"{args.batches} measured batches per engine"
        + (f"; ledger commit interval {args.ledger_interval} s" if args.ledger_interval else "")
        + (f"; ledger writer nice {args.writer_nice}" if args.writer_nice is not None else "")
    )
    print(
        f"{'engine':<10}{'median tok/s':>14}{'forward s':>11}{'rest s':>9}  steps/tokens/preempted"
    )
    for m, batches in runs.items():
        fwd = med(x["forward_s"] for x in batches)
        rest = med(x["wall_s"] - x["forward_s"] for x in batches)
        s = batches[-1]["scheduled"]
        print(
            f"{m:<10}{med(rates[m]):>14.1f}{fwd:>11.3f}{rest:>9.3f}  "
            f"{s.get('steps')}/{s.get('tokens')}/{s.get('preempted')}"
        )
    print(f"ratio governed/plain: {governed / plain:.3f} (target >= 0.95)")
    if "connector" in rates:
        floor = med(rates["connector"])
        print(
            f"ratio connector/plain (vLLM's connector path, nothing of kvguard's): "
            f"{floor / plain:.3f}; governed/connector: {governed / floor:.3f}"
        )
    print(
        f"prefill tokens avoided per batch: plain {runs['plain'][-1]['prefill_avoided']}, "
        f"governed {last['prefill_avoided']} of {last['prompt_tokens']} prompt tokens"
    )
    print(f"engine evictions (cached blocks re-assigned), last governed batch: {last['evictions']}")
    for m, batches in runs.items():
        names = sorted({k for r in batches for k in r["thread_cpu_s"]})
        cpu = {n: med(r["thread_cpu_s"].get(n, 0.0) for r in batches) for n in names}
        text = ", ".join(f"{n} {v:.2f}" for n, v in cpu.items() if v >= 0.01)
        print(f"CPU s per thread per batch, {m} (medians): {text}")
        gcs = batches[-1]["gc"]
        text = ", ".join(
            f"{g}: {int(n)} collections, {t * 1e3:.1f} ms in all"
            for g, (n, t) in sorted(gcs.items())
        )
        print(f"cyclic GC, last {m} batch: {text or 'none'}")
    c = [x["commits"] for x in runs["governed"]]
    print(
        f"ledger group commits per batch: {med(x['count'] for x in c):.0f} "
        f"({med(x['seconds'] for x in c):.3f} s); forward passes overlapping one: "
        f"{med(x['forwards_overlapped'] for x in c):.0f}, mean "
        f"{med(x['overlapped_mean_s'] for x in c) * 1e3:.2f} ms against "
        f"{med(x['clear_mean_s'] for x in c) * 1e3:.2f} ms for the others"
    )
    if "phases" not in last:
        return
    steps = max(1, int(last["steps"]))
    print(f"kvguard cost per engine step ({steps} steps in the last measured governed batch):")
    for name, v in last["phases"].items():
        print(f"  {name:<26}{v['seconds'] / steps * 1e6:10.1f} us/step  ({int(v['calls'])} calls)")
    # ledger_submit runs inside build_step / worker_output: do not count it twice.
    own = [
        sum(v["seconds"] for k, v in r["phases"].items() if k != "ledger_submit")
        for r in runs["governed"]
    ]
    share = [o / r["wall_s"] for o, r in zip(own, runs["governed"], strict=True)]
    print(
        f"kvguard's timed share of governed wall time: median {med(share):.1%}; "
        f"implied ratio {1 - med(share):.3f}"
    )


if __name__ == "__main__":
    main()
