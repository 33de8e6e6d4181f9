"""A tenant_admin cannot loosen the admin's `on_ledger_unavailable` or `quota.when_full` through
`PUT /v1/tenants/{id}/policy` (found by a review: `kvguard.policy.tighten.loosened` did not look at
either). The ledger one matters most: with `fail_closed` (the admin's choice, and the G7 default) a
request that arrives during a ledger outage is refused; had the tenant set `block`, the same
request would be deferred (`GuardedLLM` admits it to wait in the engine's queue) instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvguard.policy import Usage, Verdict, admit
from tests.api.conftest import ApiEnv
from tests.policy.conftest import scope

POLICY = "/v1/tenants/acme/policy"


def _limits(env: ApiEnv, acme: dict[str, Any]) -> dict[str, Any]:
    body = {"policy": {"tenants": {"acme": acme}}, "reason": "limits"}
    r = env.call("admin", "PUT", "/v1/policies", json=body)
    assert r.status_code == 201, r.text
    return env.call("acme", "GET", POLICY).json()["policy"]


def _acme_effective(env: ApiEnv) -> dict[str, Any]:
    current = env.call("admin", "GET", "/v1/policies/current").json()["policy"]
    return current["tenants"].get("acme", current["default"])


def test_a_tenant_admin_cannot_turn_fail_closed_into_block(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    env = make_env(any_db)
    policy = _limits(env, {"on_ledger_unavailable": "fail_closed"})
    policy["on_ledger_unavailable"] = "block"
    r = env.call("acme", "PUT", POLICY, json={"policy": policy, "reason": "keep serving"})
    effective = _acme_effective(env)
    stored = env.services.policies.current()
    assert stored is not None
    outage = admit(stored.policy, scope("acme"), Usage(), ledger_available=False)
    assert (r.status_code, effective["on_ledger_unavailable"], outage.verdict) == (
        403,
        "fail_closed",
        Verdict.REJECT,
    ), r.text


def test_a_tenant_admin_cannot_turn_quota_reject_into_wait(
    make_env: Callable[..., ApiEnv], any_db: str
) -> None:
    """`when_full` is not in the check at all. `reject` (refused at the front end, 429) is the
    admin's stricter choice; `wait` lets the tenant's excess queue inside the shared engine."""
    env = make_env(any_db)
    policy = _limits(env, {"quota": {"max_blocks": 100, "when_full": "reject"}})
    policy["quota"]["when_full"] = "wait"
    r = env.call("acme", "PUT", POLICY, json={"policy": policy, "reason": "r"})
    assert (r.status_code, _acme_effective(env)["quota"]["when_full"]) == (403, "reject"), r.text
