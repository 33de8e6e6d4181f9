"""Runs in a child process: a randomized multi-tenant workload on the real engine, with the
independent checker of `checked_connector` reading the KV tensors before every forward pass.

Usage: python -m tests.engine_adapter.stress_child WORKDIR SPEC_JSON OUT_JSON
SPEC: {"requests": N, "tenants": T, "seed": S, "kv_bytes": B, "batched_tokens": K}

Tenants share documents with each other (identical token prefixes under different scopes) and send
the same document concurrently within their own scope; prompt lengths, output lengths and arrival
are random; some requests are aborted mid-flight. The pool is small enough that the scheduler
preempts running requests and evicts cached blocks, and `max_num_batched_tokens` forces chunked
prefill. The engine's own exceptions propagate (a crash fails the run); OUT_JSON gets the checker's
counts, kvguard's counters and the custody invariant after the run.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

POLICY = """\
version: 1
default:
  reuse: tenant
tenants:
{tenants}
"""
_KINDS = [
    "{{}}",
    "{{retention: {{ttl_s: 2, idle_s: 1}}}}",
    "{{zeroize: {{on_release: cross_scope}}}}",
    "{{classification: restricted}}",
    "{{zeroize: {{on_release: always, verify: full}}}}",
]


def run(workdir: Path, spec: dict[str, Any], out_file: Path) -> None:
    from vllm import SamplingParams  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, TenantRequest, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from tests.engine_adapter import checked_connector  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import BLOCK, engine_kwargs, write_secrets  # noqa: PLC0415

    class CheckedLLM(GuardedLLM):
        connector_class = "CheckedConnector"
        connector_module = "tests.engine_adapter.checked_connector"

    rng = random.Random(spec["seed"])
    tenants = [f"t{i:02d}" for i in range(spec["tenants"])]
    secrets = write_secrets(workdir)
    lines = [f"  {t}: {_KINDS[i % len(_KINDS)].format()}" for i, t in enumerate(tenants)]
    Path(secrets["policy_file"]).write_text(POLICY.format(tenants="\n".join(lines)))
    options = GuardOptions(**secrets, canary=True)
    kwargs = {
        **engine_kwargs(spec["kv_bytes"]),
        "max_num_batched_tokens": spec["batched_tokens"],
        "max_num_seqs": 12,
    }
    g = CheckedLLM(str(tiny_llama_dir()), options=options, **kwargs)
    engine = g.llm.llm_engine
    docs = [[rng.randrange(5, 500) for _ in range(BLOCK * rng.randint(1, 6))] for _ in range(8)]
    submitted = finished = aborted = cached_tokens = 0
    live: set[str] = set()
    while submitted < spec["requests"] or live:
        while submitted < spec["requests"] and len(live) < 16 and rng.random() < 0.5:
            # A burst: one tenant sends one document 1-4 times at once (same-scope requests sharing
            # blocks in one step), each with its own suffix and output length.
            tenant = rng.choice(tenants)
            doc = docs[rng.randrange(len(docs))]
            session = f"s{rng.randrange(3)}" if rng.random() < 0.2 else None
            for _ in range(min(rng.randint(1, 4), spec["requests"] - submitted)):
                suffix = [rng.randrange(5, 500) for _ in range(rng.randint(0, 40))]
                salt, params = g._admit(
                    TenantRequest(tenant, session=session),
                    SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 96), ignore_eos=True),
                )
                rid = f"r{submitted}"
                engine.add_request(rid, g._prompt(doc + suffix, salt), params)
                live.add(rid)
                submitted += 1
        if live and rng.random() < 0.03:
            victim = rng.choice(sorted(live))
            engine.abort_request([victim])
            live.discard(victim)
            aborted += 1
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.discard(out.request_id)
                finished += 1
                cached_tokens += out.num_cached_tokens or 0
    g.settle()
    sched = g.connector.scheduler_guard
    sched.custody.check_invariants()  # G4 after the run (the canary checked it after every step)
    summary = sched.custody.summary()
    result = {
        "checker": dict(checked_connector.STATS),
        "kvguard": {k: v for k, v in sched.stats.items() if isinstance(v, int | float)},
        "submitted": submitted,
        "finished": finished,
        "aborted": aborted,
        "cached_tokens": cached_tokens,
        "active_blocks_after": summary.active,
        "quarantined_after": summary.quarantined,
    }
    g.close()
    Path(out_file).write_text(json.dumps(result))


if __name__ == "__main__":
    run(Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))
