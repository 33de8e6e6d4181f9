"""Field-by-field differences between two policy documents: pure, no I/O (`GET /v1/policies/diff`
and the dashboard's policy page show them).

Each difference is a dotted path and the value at that path in each document, compared as canonical
JSON. A tenant only one document names has, in the other, that document's `default` policy (what
`PolicySet.policy_for` gives it), so its fields are compared against the default's: naming acme
with `quota.max_blocks: null` under a default cap of 100 is a lifted cap, listed as
`tenants.acme.quota.max_blocks: 100 -> null`, and a field equal to the default is no change. The
naming itself is listed too, always, as `tenants.<id>: null -> the tenant's object` (or back): the
value at that path in each document, so adding or removing a tenant is never invisible, not even
one named with exactly the default. Any other path one document lacks (a share group only the
other defines) reads as null there.
"""

from __future__ import annotations

import json
from typing import Any

from kvguard.policy.models import PolicySet


def policy_changes(old: PolicySet, new: PolicySet) -> list[tuple[str, Any, Any]]:
    """(path, old value, new value) of every field whose value differs, sorted by path."""
    a, b = json.loads(old.canonical_json()), json.loads(new.canonical_json())
    leaves_a, leaves_b = _effective_leaves(a, b), _effective_leaves(b, a)
    changes = [
        (p, leaves_a.get(p), leaves_b.get(p))
        for p in leaves_a.keys() | leaves_b.keys()
        if _json(leaves_a.get(p)) != _json(leaves_b.get(p))
    ]
    changes += [
        (f"tenants.{t}", a["tenants"].get(t), b["tenants"].get(t))
        for t in a["tenants"].keys() ^ b["tenants"].keys()
    ]
    return sorted(changes, key=lambda change: change[0])


def _effective_leaves(document: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The leaves of `document`, plus, for each tenant only `other` names, `document`'s default
    under `tenants.<id>`: the policy that tenant has in `document`."""
    leaves = _flatten(document)
    for tenant_id in other["tenants"].keys() - document["tenants"].keys():
        leaves.update(_flatten(document["default"], f"tenants.{tenant_id}"))
    return leaves


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a policy document by dotted path. A mapping is never a leaf: an empty one
    (`tenants: {}`) has no leaves, as a tenant map that names nobody holds no fields, so adding a
    tenant does not also list `tenants: {} -> null`."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _json(value: Any) -> str:
    """`value` as canonical JSON: `True` and `1`, or `1` and `1.0`, are equal in Python but not the
    same policy value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
