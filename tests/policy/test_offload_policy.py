"""Offload policy (issue 15 item 4): off by default, refused where classification forbids it, and
never loosened by a tenant_admin."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvguard.policy import Offload, PolicySet, TenantPolicy
from kvguard.policy.tighten import loosened


def test_offload_is_off_by_default() -> None:
    policy = TenantPolicy()
    assert policy.offload == Offload(allowed=False, max_bytes=None, ttl_s=600, disk=False)
    assert PolicySet().default.offload.allowed is False


def test_restricted_tenants_may_not_offload() -> None:
    with pytest.raises(ValidationError, match=r"offload\.allowed"):
        TenantPolicy.model_validate({"classification": "restricted", "offload": {"allowed": True}})


def test_disk_needs_offload_allowed() -> None:
    with pytest.raises(ValidationError, match=r"offload\.disk"):
        TenantPolicy.model_validate({"offload": {"disk": True}})


def test_limits_are_validated() -> None:
    with pytest.raises(ValidationError, match="max_bytes"):
        TenantPolicy.model_validate({"offload": {"allowed": True, "max_bytes": 0}})
    with pytest.raises(ValidationError, match="ttl_s"):
        TenantPolicy.model_validate({"offload": {"allowed": True, "ttl_s": 10**9}})
    with pytest.raises(ValidationError, match="extra"):
        TenantPolicy.model_validate({"offload": {"allow": True}})


def test_confidential_data_reaches_disk_only_when_the_admin_says_so() -> None:
    admin = TenantPolicy.model_validate(
        {"classification": "confidential", "offload": {"allowed": True, "max_bytes": 1000}}
    )
    tenant_wants = admin.model_copy(
        update={"offload": Offload(allowed=True, max_bytes=1000, disk=True)}
    )
    assert loosened(admin, tenant_wants) == ["offload.disk"]


@pytest.mark.parametrize(
    ("limit", "proposed", "fields"),
    [
        ({}, {"allowed": True}, ["offload.allowed"]),
        ({"allowed": True, "max_bytes": 100}, {"allowed": True}, ["offload.max_bytes"]),
        (
            {"allowed": True, "max_bytes": 100},
            {"allowed": True, "max_bytes": 200},
            ["offload.max_bytes"],
        ),
        ({"allowed": True, "ttl_s": 60}, {"allowed": True, "ttl_s": 61}, ["offload.ttl_s"]),
        ({"allowed": True}, {}, []),  # turning it off tightens
        ({"allowed": True, "max_bytes": 100}, {"allowed": True, "max_bytes": 50}, []),
        ({"allowed": True}, {"allowed": True, "max_bytes": 50, "ttl_s": 10}, []),
    ],
)
def test_a_tenant_admin_may_only_tighten_offload(
    limit: dict[str, object], proposed: dict[str, object], fields: list[str]
) -> None:
    was = TenantPolicy.model_validate({"offload": limit})
    now = TenantPolicy.model_validate({"offload": proposed})
    assert loosened(was, now) == fields
