"""kvguard's scheduler-side cost per step as a fraction of vLLM's own scheduler step time (issue 14
item 7), at batch 64 and 256 on the CPU engine.

vLLM's scheduler time is `Scheduler.schedule` plus `Scheduler.update_from_output` plus
`Scheduler.add_request`; kvguard's scheduler half runs inside them: the connector's methods that
vLLM calls from them (`get_num_new_matched_tokens`, `update_state_after_alloc` and
`build_connector_meta` in `schedule`, `request_finished` and `update_connector_output` in
`update_from_output`, `on_new_request` in `add_request`), each timed from the outside with the
same clocks as vLLM's methods. (Before 2026-11-29 `add_request` was left out of the total while
`on_new_request` was taken out of it, and the gate was counted as vLLM's: the share read a few
tenths of a point too high. Until the thirtieth session kvguard's part was the sum of its internal
phase timers switched to thread CPU time, two clock system calls per phase that production never
makes, and `update_state_after_alloc` counted as vLLM's.) Each batch size runs a
plain engine and a governed one, each in its own child process, on the same workload: `batch`
requests of 16 tenants (84-token prompts sharing a per-tenant 64-token prefix, 32 tokens out), all
admitted at once (`max_num_seqs` = batch), the pool large enough for all of them (`--max-tokens`
changes the 32 tokens out). Reported per step:
vLLM's scheduler time in the plain engine, the governed engine's scheduler time with kvguard's part
taken out, kvguard's part, and kvguard's share of the governed engine's own scheduler time, in
wall time and in the scheduler thread's CPU time (wall time on this shared 2-core machine includes
waiting for a core, and for the GIL while kvguard's ledger writer builds entries; CPU time does not).
Target: <= 5%.

Run: .venv/bin/python benchmarks/scheduler_share.py [--batches 64 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
TENANTS = 16
MAX_TOKENS = 32
# kvguard's scheduler-side connector methods that vLLM calls inside the three methods above
CONNECTOR_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
    "on_new_request",
)


def workload(batch: int) -> list[tuple[str, list[int]]]:
    items = []
    for r in range(batch):
        t = r % TENANTS
        system = [(t * 53 + 11 * i) % 500 + 5 for i in range(2 * BLOCK)]
        question = [(r * 29 + t * 7 + 3 * i) % 500 + 5 for i in range(20)]
        items.append((f"tenant-{t}", system + question))
    return items


def engine_kwargs(batch: int, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    per_request = -(-(84 + max_tokens) // BLOCK) + 4  # the request's blocks, and room to spare
    return {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": BLOCK,
        "kv_cache_memory_bytes": max(64, batch * per_request) * 32 * 1024,  # 32 KiB blocks
        "max_model_len": 512,
        "max_num_seqs": batch,
        "max_num_batched_tokens": max(2048, batch * 96),
        "seed": 0,
    }


def child(mode: str, batch: int, out: Path, repeats: int, max_tokens: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415

    from benchmarks.engine_overhead import PhaseClock, open_engine  # noqa: PLC0415

    clock = PhaseClock(cpu=True)  # vLLM's scheduler methods; steps counted by `schedule`
    for name in ("schedule", "update_from_output", "add_request"):  # add_request: vLLM's intake
        clock.wrap(Scheduler, name, name)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run, g = open_engine(mode, workload(batch), params, engine_kwargs(batch, max_tokens))
    kvguard = PhaseClock(cpu=True)
    if g is not None:
        for name in CONNECTOR_METHODS:  # the scheduler's connector, the one vLLM calls
            kvguard.wrap(g.connector, name, name)
    run()  # warm-up: the measured run sees the same prefix hits in both engines
    clock.reset()
    kvguard.reset()
    for _ in range(repeats):
        run()
    result: dict[str, object] = {
        "sched_s": sum(clock.seconds.values()),
        "sched_cpu_s": sum(clock.cpu_seconds.values()),
        "steps": clock.calls["schedule"],
    }
    if g is not None:
        result["kvguard_s"] = sum(kvguard.seconds.values())
        result["kvguard_cpu_s"] = sum(kvguard.cpu_seconds.values())
        g.close()
    out.write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["plain", "governed"])
    ap.add_argument("--batch", type=int)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=3, help="measured runs of the workload per child (default 3)"
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        help=f"tokens out per request (default {MAX_TOKENS}: a short-output, high-churn workload)",
    )
    args = ap.parse_args()
    if args.child:
        child(args.child, args.batch, args.out, args.repeats, args.max_tokens)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            runs: dict[str, list[dict]] = {"plain": [], "governed": []}
            for r in range(args.rounds):
                for mode in ("plain", "governed"):
                    out = Path(tmp) / f"{mode}-{batch}-{r}.json"
                    command = [
                        *(sys.executable, __file__, "--child", mode, "--batch", str(batch)),
                        *("--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens)),
                    ]
                    subprocess.run(
                        [*command, "--out", str(out)],
                        check=True,
                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                        cwd=ROOT,
                        capture_output=True,
                    )
                    runs[mode].append(json.loads(out.read_text()))
                    print(f"batch {batch} round {r} {mode} done", file=sys.stderr)

            def per_step(run: dict, key: str) -> float:
                return float(run.get(key, 0.0)) / max(1, int(run["steps"])) * 1e6

            for clock_name, total_key, kv_key in (
                ("wall", "sched_s", "kvguard_s"),
                ("cpu", "sched_cpu_s", "kvguard_cpu_s"),
            ):
                plain = statistics.median(per_step(x, total_key) for x in runs["plain"])
                gov = [(per_step(x, total_key), per_step(x, kv_key)) for x in runs["governed"]]
                kvg = statistics.median(k for _, k in gov)
                own = statistics.median(total - k for total, k in gov)
                share = statistics.median(k / (total - k) for total, k in gov)
                rows.append((batch, clock_name, plain, own, kvg, share, kvg / plain))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
        f"; {args.max_tokens} tokens out per request"
    )
    print(
        f"{'batch':>6}{'clock':>6}{'plain sched us/step':>21}{'governed, vLLM part':>21}"
        f"{'kvguard us/step':>17}{'share of own':>14}{'vs plain':>10}"
    )
    for batch, clock_name, plain, own, kvg, share, vs_plain in rows:
        print(
            f"{batch:>6}{clock_name:>6}{plain:>21.1f}{own:>21.1f}{kvg:>17.1f}{share:>13.1%}"
            f"{vs_plain:>10.1%}"
        )
    print("target: kvguard's scheduler-side cost <= 5% of vLLM's scheduler step")


if __name__ == "__main__":
    main()
