"""`kvguard.policy.tighten`: every field of a tenant's policy is ruled on, and each ordered one is
refused when a tenant_admin's proposal loosens it and taken when it tightens it (a review found
`quota.when_full` and `on_ledger_unavailable` unchecked: nothing held the check to the model)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from kvguard.policy.models import TenantPolicy
from kvguard.policy.tighten import RULED, loosened


def _fields(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from _fields(kind, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_every_field_of_a_tenant_policy_is_ruled_on() -> None:
    assert set(_fields(TenantPolicy)) == RULED


# (field, the admin's limit, a looser proposal): the tighter direction is the pair reversed.
_ORDERED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("classification", {"classification": "confidential"}, {"classification": "internal"}),
    ("reuse", {"reuse": "tenant"}, {"reuse": "group", "groups": ["g"]}),
    ("retention.ttl_s", {"retention": {"ttl_s": 60, "idle_s": 60}}, {"retention": {"ttl_s": 120, "idle_s": 60}}),
    ("retention.idle_s", {"retention": {"ttl_s": 600, "idle_s": 60}}, {"retention": {"ttl_s": 600, "idle_s": 120}}),
    ("quota.max_blocks", {"quota": {"max_blocks": 10}}, {"quota": {"max_blocks": 20}}),
    ("quota.when_full", {"quota": {"max_blocks": 10, "when_full": "reject"}}, {"quota": {"max_blocks": 10, "when_full": "wait"}}),
    ("zeroize.on_release", {"zeroize": {"on_release": "always"}}, {"zeroize": {"on_release": "cross_scope"}}),
    ("zeroize.verify", {"zeroize": {"verify": "full"}}, {"zeroize": {"verify": "sample"}}),
    ("audit", {"audit": "full"}, {"audit": "standard"}),
    ("offload.ttl_s", {"offload": {"allowed": True, "ttl_s": 60}}, {"offload": {"allowed": True, "ttl_s": 120}}),
    ("on_ledger_unavailable", {"on_ledger_unavailable": "fail_closed"}, {"on_ledger_unavailable": "block"}),
]  # fmt: skip


@pytest.mark.parametrize(("field", "limit", "looser"), _ORDERED, ids=[f for f, _, _ in _ORDERED])
def test_a_looser_value_is_refused_and_a_tighter_one_taken(
    field: str, limit: dict[str, Any], looser: dict[str, Any]
) -> None:
    strict, loose = TenantPolicy.model_validate(limit), TenantPolicy.model_validate(looser)
    assert loosened(strict, loose) == [field]
    assert loosened(loose, strict) == []
