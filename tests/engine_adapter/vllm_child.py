"""Runs in a child process: plain vLLM or governed vLLM (multiprocess mode) on given prompts, or a
governed engine that serves commands from a control database.

Usage: python -m tests.engine_adapter.vllm_child {plain|governed-mp} WORKDIR PROMPTS_JSON OUT_JSON
       python -m tests.engine_adapter.vllm_child governed-commands WORKDIR SPEC_JSON OUT_JSON

`governed-commands` (see `serve_commands`) runs an in-process governed engine whose control database
(commands, engine registry) and policy store are `SPEC["control_url"]`; keys, signing key, policy file
and ledger are written under WORKDIR. It warms the cache of `SPEC["tenants"]` with `SPEC["prompt"]`,
writes `{"engine_id": ...}` to `SPEC["ready_file"]`, then sends a small request every 0.2 s (an engine
runs commands only when a request arrives or a step runs) until `SPEC["stop_file"]` exists or
`SPEC["timeout_s"]` passes. Last, it sends the prompt once more per tenant and writes the cached-token
counts of those requests and the policy version in force to OUT_JSON, and shuts the engine down.
`SPEC["options"]` (GuardOptions fields) replaces the per-child secrets and ledger; `SPEC["keepalive"]`
names the tenant of the small requests; `SPEC["flood"]` prompts of tenant `flood` after the warm-up
evict the device cache (an engine with an offload tier spills the tenants' blocks).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def serve_commands(workdir: Path, spec: dict[str, Any], out_file: Path) -> None:
    from vllm import SamplingParams  # noqa: PLC0415

    from kvguard.control.engines import EngineRegistry  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from kvguard.errors import AdmissionError  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    url = spec["control_url"]
    # `SPEC["options"]` overrides the per-child secrets and ledger: replicas of one deployment share
    # the keyring, the signing key and one ledger database.
    shared = {k: Path(v) if k.endswith("_file") else v for k, v in spec.get("options", {}).items()}
    settings = {**write_secrets(workdir), **shared}
    options = GuardOptions(**settings, commands_url=url, policy_url=url)
    g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
    # In multiprocess mode (`SPEC["idle"]`: the engine core runs in its own process) the guard is
    # not reachable from here; the engine id comes from the engine registry instead.
    sched = g.connector.scheduler_guard if g.connector is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt, tenants = spec["prompt"], spec["tenants"]
    for tenant in tenants:
        g.generate([prompt], params, tenant=tenant)
    for i in range(spec.get("flood", 0)):  # distinct 6-block prompts: evict the device cache
        flood = [(37 * (1000 + i) + 11 * j) % 480 + 7 for j in range(6 * 32 + 1)]
        g.generate([flood], params, tenant="flood")
    engine_id = sched.engine_id if sched else EngineRegistry.open(url).engines()[-1].engine_id
    # Written whole, then renamed: a reader never sees it half written.
    ready = Path(spec["ready_file"])
    ready.with_suffix(".tmp").write_text(json.dumps({"engine_id": engine_id}))
    ready.with_suffix(".tmp").replace(ready)
    deadline = time.monotonic() + spec.get("timeout_s", 120)
    while not Path(spec["stop_file"]).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
        if not spec.get("idle"):  # idle: no requests at all, the engine must wake by itself
            g.generate([[5, 6, 7]], params, tenant=spec.get("keepalive", "child-keepalive"))
    after: dict[str, int | str] = {}
    for tenant in tenants:
        try:
            after[tenant] = g.generate([prompt], params, tenant=tenant)[0].num_cached_tokens
        except AdmissionError as exc:  # a tenant disabled by a policy command
            after[tenant] = f"refused: {exc}"
    result = {"after": after, "policy_version": sched.policy_version if sched else None}
    g.close()
    Path(out_file).write_text(json.dumps(result))


def serve_tensor_parallel(workdir: Path, out_file: Path) -> None:
    """A governed engine with tensor parallel 2 (two worker processes, each with a shard of every
    block) and the canary on: every block entering a new scope must read all-zero on each rank
    before its forward pass. Two tenants share a prompt prefix; one is purged."""
    from vllm import SamplingParams  # noqa: PLC0415

    from kvguard.audit.ledger import Ledger  # noqa: PLC0415
    from kvguard.audit.signing import SigningKey  # noqa: PLC0415
    from kvguard.engine_adapter.records import PurgeKind, PurgeSelector  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import (  # noqa: PLC0415
        BLOCK,
        engine_kwargs,
        write_secrets,
    )

    secrets = write_secrets(workdir)
    options = GuardOptions(**secrets, canary=True)
    g = GuardedLLM(
        str(tiny_llama_dir()), options=options, tensor_parallel_size=2, **engine_kwargs(256 << 10)
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [(37 * i + 11) % 500 + 5 for i in range(3 * BLOCK)] + [7]
    first = {t: g.generate([prompt], params, tenant=t)[0] for t in ("tp-a", "tp-b")}
    again = {t: g.generate([prompt], params, tenant=t)[0] for t in ("tp-a", "tp-b")}
    g.purge(PurgeSelector(PurgeKind.TENANT, "tp-a"))
    after = g.generate([prompt], params, tenant="tp-a")[0]
    # A flood of other tenants evicts cached blocks: handovers cleared on both ranks.
    for n in range(40):
        g.generate([[(n * 13 + i) % 400 + 5 for i in range(2 * BLOCK + 3)]], params, tenant=f"f{n}")
    g.sync()
    sched = g.connector.scheduler_guard
    stats, num_blocks = sched.stats, sched.custody.num_blocks
    g.close()
    ledger = Ledger.open(
        secrets["ledger_url"],
        origin=secrets["ledger_origin"],
        signing_key=SigningKey.load(secrets["signing_key_file"]),
    )
    zeroizes = [
        r.event.details for r in ledger.query(kinds=["block.zeroize"], limit=10_000).records
    ]
    ledger.close()
    result = {
        "tokens": {t: list(o.outputs[0].token_ids) for t, o in first.items()},
        "tokens_again": {t: list(o.outputs[0].token_ids) for t, o in again.items()},
        "cached_first": {t: o.num_cached_tokens for t, o in first.items()},
        "cached_again": {t: o.num_cached_tokens for t, o in again.items()},
        "cached_after_purge": after.num_cached_tokens,
        "zeroize_entries": len(zeroizes),
        "handover_entries": sum(1 for d in zeroizes if d.get("handover")),
        "release_entries": sum(1 for d in zeroizes if not d.get("handover")),
        "tp_sizes": sorted({d.get("tp_size") for d in zeroizes}, key=str),
        "tp_ranks": sorted({str(d.get("tp_ranks")) for d in zeroizes}),
        "num_blocks": num_blocks,
        "zeroize_failures": stats["zeroize_failures"],
        "custody_repairs": stats["custody_repairs"],
    }
    Path(out_file).write_text(json.dumps(result))


def main() -> None:
    mode, workdir, prompts_file, out_file = sys.argv[1:5]
    if mode == "governed-tp":
        serve_tensor_parallel(Path(workdir), Path(out_file))
        return
    if mode == "governed-commands":
        spec = json.loads(Path(prompts_file).read_text())
        serve_commands(Path(workdir), spec, Path(out_file))
        return
    from vllm import LLM, SamplingParams  # noqa: PLC0415 (after argument parsing: import is slow)

    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import engine_kwargs, write_secrets  # noqa: PLC0415

    items = json.loads(Path(prompts_file).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    result: dict[str, object] = {}
    if mode == "plain":
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        llm = LLM(model=str(tiny_llama_dir()), enable_prefix_caching=True, **engine_kwargs())
        outs = [
            llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
            for _, p in items
        ]
    else:
        options = GuardOptions(**write_secrets(Path(workdir)))
        g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
        result["in_process"] = g.connector is not None
        outs = [g.generate([p], params, tenant=t)[0] for t, p in items]
        g.llm.llm_engine.engine_core.shutdown()
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    result["cached"] = [o.num_cached_tokens for o in outs]
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
