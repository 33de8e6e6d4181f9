"""Cross-field rules of a policy document, as (field path, message) problems.

Kept apart from the models so each rule reads as one line of policy and can be tested on its own. Paths
are relative to the model checked (`reuse`, `retention.ttl_s`); the loader prefixes the model's own
location (`tenants.acme.`). Every rule closes a way a document could look stricter than it is.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from kvguard.isolation.scope import TENANT_ID_PATTERN
from kvguard.policy.enums import MAX_REUSE, Classification, Reuse, Verify, ZeroizeOn

if TYPE_CHECKING:  # the models call these rules from their validators, so they import this module
    from kvguard.policy.models import PolicySet, TenantPolicy

Problem = tuple[str, str]
_TENANT_ID = re.compile(TENANT_ID_PATTERN)


def tenant_problems(policy: TenantPolicy) -> list[Problem]:
    """Rules that one tenant policy must satisfy on its own."""
    if policy.classification is Classification.RESTRICTED:
        return _restricted_problems(policy)
    problems: list[Problem] = []
    ceiling = MAX_REUSE[policy.classification]
    if policy.reuse.rank > ceiling.rank:
        problems.append(
            (
                "reuse",
                f"{policy.classification} tenants may reuse at most '{ceiling}' "
                f"(got '{policy.reuse}')",
            )
        )
    if policy.offload.disk and not policy.offload.allowed:
        problems.append(("offload.disk", "offload to disk needs offload.allowed: true"))
    if policy.reuse is Reuse.GROUP and not policy.groups:
        problems.append(("groups", "reuse 'group' needs at least one share-group membership"))
    retention = policy.retention
    if retention.idle_s > retention.ttl_s:
        problems.append(
            (
                "retention.idle_s",
                f"idle_s ({retention.idle_s}) exceeds ttl_s ({retention.ttl_s}): "
                "a block would always reach its TTL first",
            )
        )
    if (
        policy.classification is Classification.CONFIDENTIAL
        and policy.zeroize.verify is Verify.NONE
    ):
        problems.append(
            (
                "zeroize.verify",
                "confidential tenants need verified zeroization ('sample' or 'full')",
            )
        )
    return problems


def _restricted_problems(policy: TenantPolicy) -> list[Problem]:
    # Restricted means: nothing is shared, nothing outlives its request, every block is wiped and
    # every wipe is read back. Each deviation is named so the admin sees exactly what to remove.
    problems: list[Problem] = []
    if policy.reuse is not Reuse.NONE:
        problems.append(
            (
                "reuse",
                f"restricted tenants may not reuse KV state: must be 'none' (got '{policy.reuse}')",
            )
        )
    if policy.retention.ttl_s != 0:
        problems.append(
            ("retention.ttl_s", "restricted tenants may not retain KV state: must be 0")
        )
    if policy.retention.idle_s != 0:
        problems.append(
            ("retention.idle_s", "restricted tenants may not retain KV state: must be 0")
        )
    if policy.zeroize.on_release is not ZeroizeOn.ALWAYS:
        problems.append(("zeroize.on_release", "restricted tenants must zeroize 'always'"))
    if policy.offload.allowed:
        problems.append(
            ("offload.allowed", "restricted tenants may not keep KV state in an offload tier")
        )
    if policy.zeroize.verify is not Verify.FULL:
        problems.append(
            ("zeroize.verify", "restricted tenants must verify every zeroization ('full')")
        )
    if policy.groups:
        problems.append(("groups", "restricted tenants may not join share groups"))
    return problems


def policy_set_problems(policy_set: PolicySet, *, check_ids: bool = True) -> list[Problem]:
    """Rules that relate tenants, the default and share groups to each other (`check_ids`: also
    that every tenant entry is keyed by a possible tenant id; off for a stored version)."""
    problems: list[Problem] = []
    for position, tenant_id in enumerate(policy_set.tenants if check_ids else (), start=1):
        if not _TENANT_ID.fullmatch(tenant_id):
            # A name no tenant can be registered under ("acme " for "acme") would leave the tenant
            # on the default while the document reads as if it were restricted. By position, not
            # by name: an error never echoes a value the caller sent.
            problems.append(
                (
                    "tenants",
                    f"entry {position} is not a tenant id (1-128 letters, digits and . _ : @ -, "
                    "starting with a letter or digit): no tenant could ever get it",
                )
            )
    if problems:
        return problems  # the rules below name tenants by their keys
    if policy_set.default.groups:
        problems.append(
            (
                "default.groups",
                "the default policy applies to every unnamed tenant and may not grant "
                "share-group membership",
            )
        )
    for tenant_id, policy in policy_set.tenants.items():
        for n, group in enumerate(policy.groups):
            if group not in policy_set.share_groups:
                # By position, not by name: an error never echoes a value the caller sent.
                problems.append(
                    (f"tenants.{tenant_id}.groups.{n}", "names a share group share_groups lacks")
                )
    return problems
