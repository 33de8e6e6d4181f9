"""Governed vs plain vLLM on the same workload: tokens/s ratio and kvguard's per-step cost.

Each engine runs in its own child process (vLLM keeps process-global state); the parent alternates
plain and governed runs (plain, governed, plain, governed, ...) so drift on the shared machine hits
both alike, and reports the ratio of the medians. Plain vLLM gets the same per-tenant salts as
client-supplied `cache_salt` values, so both engines see the same cache hits: the difference is
kvguard's own work (custody, policy, ledger, zeroization), not the isolation it enforces.

Target (issues 5 and 10): governed/plain >= 0.95 on the tiny CPU model, the worst case, where per-step
Python overhead dominates, also with the KV pool full and the engine evicting (`--kv-kib 1024
--tenants 16`: 64 blocks for 16 tenants' distinct prefixes, so every batch evicts cached blocks).
Run: .venv/bin/python benchmarks/engine_overhead.py [--rounds 3] [--kv-kib N] [--tenants T]
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
import time
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
    mode: str, items: list[tuple[str, list[int]]], params: Any, kwargs: dict[str, object]
) -> tuple[Callable[[], list], Any]:
    """A plain vLLM engine (per-tenant client salts) or a governed one (kvguard's), in this process,
    and a function running `items` through it in one batch; the second value is the `GuardedLLM`
    (None for plain). Shared by the benchmarks that compare the two on one workload."""
    from kvguard.engine_adapter.vllm.guarded import TenantRequest, tiny_llama_dir  # noqa: PLC0415

    if mode == "plain":
        from vllm import LLM  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        llm = LLM(model=str(tiny_llama_dir()), enable_prefix_caching=True, **kwargs)
        prompts = [TokensPrompt(prompt_token_ids=p, cache_salt=t) for t, p in items]
        return lambda: llm.generate(prompts, params, use_tqdm=False), None
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import write_secrets  # noqa: PLC0415

    opts = GuardOptions(**write_secrets(Path(tempfile.mkdtemp())), verify_override="sample")
    g = GuardedLLM(str(tiny_llama_dir()), options=opts, **kwargs)
    batch = [(TenantRequest(t), p) for t, p in items]
    return lambda: g.generate_batch(batch, params), g


def child(mode: str, out: Path, kv_bytes: int, tenants: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    run, g = open_engine(mode, workload(tenants), params, engine_kwargs(kv_bytes))
    run()  # warm-up (also fills the cache so measured runs see the same hits)
    before = _phases(g) if mode == "governed" else {}
    start = time.perf_counter()
    outs = run()
    wall = time.perf_counter() - start
    result: dict[str, object] = {
        "wall_s": wall,
        "generated": sum(len(o.outputs[0].token_ids) for o in outs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "prefill_avoided": sum(o.num_cached_tokens for o in outs),
    }
    if mode == "governed":
        after = _phases(g)
        result["phases"] = {
            k: {
                "seconds": v["seconds"] - before.get(k, {}).get("seconds", 0.0),
                "calls": v["calls"] - before.get(k, {}).get("calls", 0),
            }
            for k, v in after.items()
        }
        result["steps"] = after["build_step"]["calls"] - before["build_step"]["calls"]
        result["evictions"] = g.connector.scheduler_guard.reporter.counts["evictions"]
        g.close()
    out.write_text(json.dumps(result))


def _phases(g) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    sched = g.connector.scheduler_guard
    return {**sched.timer.snapshot(), **get_kv_transfer_group().worker_guard.timer.snapshot()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["plain", "governed"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-kib", type=int, default=8192, help="KV pool size (KiB)")
    ap.add_argument("--tenants", type=int, default=TENANTS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out, args.kv_kib << 10, args.tenants)
        return
    runs: dict[str, list[dict]] = {"plain": [], "governed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("plain", "governed"):
                out = Path(tmp) / f"{mode}-{r}.json"
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        mode,
                        "--out",
                        str(out),
                        "--kv-kib",
                        str(args.kv_kib),
                        "--tenants",
                        str(args.tenants),
                    ],
                    check=True,
                    env=env,
                    cwd=ROOT,
                    capture_output=True,
                )
                runs[mode].append(json.loads(out.read_text()))
                rate = runs[mode][-1]["generated"] / runs[mode][-1]["wall_s"]
                print(f"round {r} {mode:<8} {rate:8.1f} generated tok/s", file=sys.stderr)
    rates = {m: [x["generated"] / x["wall_s"] for x in v] for m, v in runs.items()}
    plain, governed = statistics.median(rates["plain"]), statistics.median(rates["governed"])
    last = runs["governed"][-1]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )
    print(
        f"workload: {args.tenants} tenants x {PER_TENANT} requests, 84-token prompts, "
        f"{MAX_TOKENS} tokens out, KV pool {args.kv_kib} KiB"
    )
    print(f"{'engine':<10}{'median tok/s':>14}{'runs':>40}")
    for m in ("plain", "governed"):
        print(f"{m:<10}{statistics.median(rates[m]):>14.1f}{[round(x, 1) for x in rates[m]]!s:>40}")
    print(f"ratio governed/plain: {governed / plain:.3f} (target >= 0.95)")
    print(
        f"prefill tokens avoided per run: plain {runs['plain'][-1]['prefill_avoided']}, "
        f"governed {last['prefill_avoided']} of {last['prompt_tokens']} prompt tokens"
    )
    print(f"engine evictions (cached blocks re-assigned), last governed run: {last['evictions']}")
    steps = max(1, int(last["steps"]))
    print(f"kvguard cost per engine step ({steps} steps in the last measured governed run):")
    for name, v in last["phases"].items():
        print(f"  {name:<18}{v['seconds'] / steps * 1e6:10.1f} us/step  ({int(v['calls'])} calls)")
    # ledger_submit runs inside build_step / worker_output: do not count it twice.
    own = [
        sum(v["seconds"] for k, v in r["phases"].items() if k != "ledger_submit")
        for r in runs["governed"]
    ]
    share = [o / r["wall_s"] for o, r in zip(own, runs["governed"], strict=True)]
    print(
        f"kvguard's share of governed wall time: median {statistics.median(share):.1%} "
        f"(per run {[round(x, 3) for x in share]}); implied ratio {1 - statistics.median(share):.3f}"
    )


if __name__ == "__main__":
    main()
