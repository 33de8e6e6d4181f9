from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvguard.isolation import Share
from kvguard.policy import (
    MAX_REUSE,
    AuditLevel,
    Classification,
    LedgerUnavailable,
    PolicySet,
    Quota,
    Retention,
    Reuse,
    ShareGroup,
    TenantPolicy,
    Verify,
    Zeroize,
    ZeroizeOn,
    prefix_digest,
)
from tests.policy.conftest import PREFIX_DIGEST, policy_set


def test_defaults_are_the_secure_ones() -> None:
    p = TenantPolicy()
    assert p.classification is Classification.INTERNAL
    assert p.reuse is Reuse.TENANT  # no cross-tenant reuse
    assert not p.reuse.allows(Share.GROUP) and not p.reuse.allows(Share.PUBLIC)
    assert p.zeroize.on_release is ZeroizeOn.ALWAYS
    assert p.zeroize.verify is Verify.SAMPLE
    assert (p.retention.ttl_s, p.retention.idle_s) == (3600, 600)
    assert p.quota.max_blocks is None
    assert p.audit is AuditLevel.STANDARD
    assert p.on_ledger_unavailable is LedgerUnavailable.FAIL_CLOSED
    assert p.enabled and p.groups == ()


def test_restricted_alone_is_a_complete_policy_with_no_reuse_and_no_retention() -> None:
    p = TenantPolicy.model_validate({"classification": "restricted"})
    assert p.reuse is Reuse.NONE
    assert (p.retention.ttl_s, p.retention.idle_s) == (0, 0)
    assert p.zeroize.on_release is ZeroizeOn.ALWAYS and p.zeroize.verify is Verify.FULL


def test_restricted_defaults_do_not_override_explicit_values() -> None:
    # An explicit contradiction is reported, not silently replaced by the restricted value.
    with pytest.raises(ValidationError, match=r"retention\.ttl_s: restricted"):
        TenantPolicy.model_validate({"classification": "restricted", "retention": {"ttl_s": 5}})


def _problems(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        TenantPolicy.model_validate(data)
    return str(info.value)


@pytest.mark.parametrize("classification", list(Classification))
@pytest.mark.parametrize("reuse", list(Reuse))
def test_reuse_is_bounded_by_classification(classification: Classification, reuse: Reuse) -> None:
    data: dict[str, Any] = {"classification": classification, "reuse": reuse}
    if reuse is Reuse.GROUP:
        data["groups"] = ["g"]
    if reuse.rank <= MAX_REUSE[classification].rank:
        assert TenantPolicy.model_validate(data).reuse is reuse
    else:
        assert "reuse:" in _problems(data)


def test_restricted_never_reuses_and_confidential_never_public() -> None:
    assert MAX_REUSE[Classification.RESTRICTED] is Reuse.NONE
    assert MAX_REUSE[Classification.CONFIDENTIAL] is Reuse.GROUP
    assert "restricted tenants may not reuse" in _problems(
        {"classification": "restricted", "reuse": "public"}
    )


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"reuse": "group"}, "groups: reuse 'group' needs at least one share-group membership"),
        ({"retention": {"ttl_s": 60, "idle_s": 61}}, "retention.idle_s: idle_s (61) exceeds ttl_s"),
        ({"retention": {"ttl_s": -1}}, "greater than or equal to 0"),
        ({"retention": {"idle_s": -1}}, "greater than or equal to 0"),
        ({"retention": {"ttl_s": 10**9}}, "less than or equal to"),
        ({"quota": {"max_blocks": 0}}, "greater than or equal to 1"),
        ({"groups": ["g", "g"]}, "duplicate share group (entry 2"),
        ({"classification": "confidential", "zeroize": {"verify": "none"}}, "verified zeroization"),
        ({"classification": "restricted", "zeroize": {"on_release": "cross_scope"}}, "'always'"),
        ({"classification": "restricted", "zeroize": {"verify": "sample"}}, "('full')"),
        (
            {"classification": "restricted", "retention": {"ttl_s": 0, "idle_s": 1}},
            "idle_s: restricted",
        ),
        ({"classification": "restricted", "groups": ["g"]}, "may not join share groups"),
        ({"reuse": "everyone"}, "Input should be"),
        ({"ttl_s": 5}, "Extra inputs are not permitted"),  # a key at the wrong level
    ],
)
def test_tenant_invariants_are_refused_with_the_field(data: dict[str, Any], expected: str) -> None:
    assert expected in _problems(data)


def test_groups_are_sorted_so_equal_documents_digest_alike() -> None:
    a = policy_set(
        {"t": {"reuse": "group", "groups": ["g", "h"]}},
        share_groups={
            "g": {"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}]},
            "h": {"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}]},
        },
    )
    b = PolicySet.model_validate_json(a.canonical_json().replace('["g","h"]', '["h","g"]'))
    assert b.tenants["t"].groups == ("g", "h")
    assert a.digest() == b.digest()


def test_policy_set_cross_references() -> None:
    with pytest.raises(ValidationError, match=r"groups\.0: names a share group share_groups lacks"):
        policy_set({"t": {"reuse": "group", "groups": ["nope"]}})
    with pytest.raises(ValidationError, match="default policy applies to every unnamed tenant"):
        policy_set(default={"reuse": "group", "groups": ["g"]})


@pytest.mark.parametrize(
    "name",
    [
        "acme ",
        "\uff41\uff43\uff4d\uff45",
        "acme\u200b",
        "x" * 129,
        "-acme",
        "a/b",
        "kvguard/ungoverned",
    ],
)
def test_a_tenant_entry_no_tenant_could_ever_have_is_refused(name: str) -> None:
    """A typo ("acme " for "acme", a full-width or zero-width character, a name too long) would
    leave the tenant on the default while the document reads as if it set its policy; the error
    names the entry's position, never the name. kvguard's own pseudo tenant is no tenant id."""
    with pytest.raises(ValidationError, match="entry 2 is not a tenant id") as caught:
        policy_set({"acme": {}, name: {"classification": "restricted"}})
    assert name not in str(caught.value)
    assert policy_set({"acme": {}, "a.b_c:d@e-f": {}}).tenants  # every allowed character


@pytest.mark.parametrize(
    ("group", "expected"),
    [
        ({"prefixes": []}, "at least 1 item"),
        ({"prefixes": [{"id": "p", "digest": "md5:abc"}]}, "should match pattern"),
        ({"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}] * 2}, "duplicate prefix id"),
        (
            {
                "prefixes": [
                    {"id": "p", "digest": PREFIX_DIGEST},
                    {"id": "q", "digest": PREFIX_DIGEST},
                ]
            },
            "duplicate prefix digest",
        ),
        ({"prefixes": [{"id": "p", "digest": PREFIX_DIGEST}], "min_shared_tokens": 0}, "greater"),
        ({"prefixes": [{"id": "p", "text": "You are a helpful"}]}, "Extra inputs"),
    ],
)
def test_share_group_rules(group: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        policy_set(share_groups={"g": group})


def test_policy_set_is_frozen_and_version_is_pinned() -> None:
    p = policy_set()
    with pytest.raises(ValidationError):
        p.epoch = 1  # type: ignore[misc]
    with pytest.raises(ValidationError, match="version"):
        policy_set(version=2)


def test_policy_for_falls_back_to_the_default() -> None:
    p = policy_set({"acme": {"reuse": "session"}}, default={"reuse": "none"})
    assert p.policy_for("acme").reuse is Reuse.SESSION
    assert p.policy_for("unknown").reuse is Reuse.NONE


def test_canonical_json_round_trips_and_digest_tracks_content() -> None:
    p = policy_set({"acme": {"retention": {"ttl_s": 60, "idle_s": 60}}})
    again = PolicySet.model_validate_json(p.canonical_json())
    assert again == p and again.digest() == p.digest()
    assert p.digest().startswith("sha256:") and len(p.digest()) == 71
    assert policy_set({"acme": {"retention": {"ttl_s": 61, "idle_s": 60}}}).digest() != p.digest()


def test_prefix_digest_is_length_prefixed_and_stable() -> None:
    assert prefix_digest([1, 2]) != prefix_digest([1, 2, 0])
    assert prefix_digest([258]) != prefix_digest([1, 2])
    assert prefix_digest(iter([1, 2])) == prefix_digest([1, 2])


def test_docs_describe_every_field() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "policy.md").read_text()
    models = (PolicySet, TenantPolicy, ShareGroup, Retention, Quota, Zeroize)
    for model in models:
        for name in model.model_fields:
            spelled = (f"`{name}`", f".{name}`", f"`{name}.")
            assert any(s in docs for s in spelled), f"{model.__name__}.{name} undocumented"
    for enum in (Classification, Reuse, ZeroizeOn, Verify, AuditLevel, LedgerUnavailable):
        for member in enum:
            assert f"`{member.value}`" in docs, f"{enum.__name__}.{member.value} undocumented"


def test_an_entry_passes_its_rules_once_and_a_bad_one_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pydantic runs a TenantPolicy's rules again whenever the object goes into a set being
    validated; an object that passed them is not checked again, one that failed always is."""
    import kvguard.policy.models as models  # noqa: PLC0415

    checked: list[object] = []
    real = models.tenant_problems

    def counting(policy: TenantPolicy) -> list[tuple[str, str]]:
        checked.append(policy)
        return real(policy)

    monkeypatch.setattr(models, "tenant_problems", counting)
    entry = TenantPolicy(retention={"ttl_s": 60, "idle_s": 30})
    assert checked == [entry]
    for _ in range(3):
        PolicySet.model_validate({"tenants": {"a": entry, "b": entry}})
    assert [c for c in checked if c is entry] == [entry]
    bad = TenantPolicy.model_construct(classification=Classification.RESTRICTED, reuse=Reuse.TENANT)
    for _ in range(2):
        with pytest.raises(ValidationError, match="restricted"):
            PolicySet.model_validate({"tenants": {"a": bad}})
    assert [c for c in checked if c is bad] == [bad, bad]


def test_an_entry_that_can_change_is_checked_every_time() -> None:
    """`model_construct` takes a list where the model holds a tuple: such an object is not
    remembered as checked, so emptying its list later is caught."""
    groups = ["g"]
    entry = TenantPolicy.model_construct(reuse=Reuse.GROUP, groups=groups)
    policies = policy_set()
    PolicySet.model_validate({**dict(policies), "tenants": {"a": entry}})
    groups.clear()
    with pytest.raises(ValidationError, match="needs at least one share-group membership"):
        PolicySet.model_validate({**dict(policies), "tenants": {"a": entry}})
