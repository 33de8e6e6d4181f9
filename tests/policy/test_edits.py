"""An edit of a validated set is validated part by part (`kvguard.policy.edits`): the same verdict and
the same set as parsing the whole stored document, and every bad edit still refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.errors import PolicyValidationError
from kvguard.policy import PolicySet, PolicyStore, TenantPolicy
from kvguard.policy.edits import CanonicalParts, checked_edit
from kvguard.policy.loading import parse_policy
from kvguard.policy.models import Quota, Retention
from kvguard.policy.store import PolicyVersion
from tests.policy.conftest import policy_set
from tests.policy.test_decisions_properties import policy_sets, tenant_policies

TENANT_IDS = st.sampled_from(["a", "b", "c", "d", "a-b@c:d_e", "Z", "a.b"])


def _reader(policy: PolicySet) -> PolicySet:
    """What a reader of the stored document gets."""
    return parse_policy(policy.canonical_json(), "test", fmt="json")


def _with(base: PolicySet, tenant: str, entry: TenantPolicy, **top: Any) -> PolicySet:
    """An edit that keeps every other part of `base` as the same object (as the API's edit does)."""
    return PolicySet.model_validate(
        {
            "version": base.version,
            "epoch": top.get("epoch", base.epoch),
            "default": base.default,
            "tenants": {**base.tenants, tenant: entry},
            "share_groups": base.share_groups,
        }
    )


@settings(max_examples=150, deadline=None)
@given(policy_sets(), TENANT_IDS, tenant_policies())
def test_an_edit_validated_by_parts_is_what_a_reader_parses(
    generated: PolicySet, tenant: str, entry: dict[str, Any]
) -> None:
    base = _reader(generated)
    parts = CanonicalParts()
    edited = _with(base, tenant, TenantPolicy.model_validate(entry))
    checked = checked_edit(edited, base, parts)
    assert checked is not None
    assert checked == _reader(edited)
    assert list(checked.tenants) == list(_reader(edited).tenants)  # the reader's order too
    assert parts.document(checked) == edited.canonical_json()


@settings(max_examples=100, deadline=None)
@given(policy_sets())
def test_the_assembled_document_is_the_canonical_json(generated: PolicySet) -> None:
    parts = CanonicalParts()
    assert parts.document(generated) == generated.canonical_json()
    assert parts.document(generated) == generated.canonical_json()  # from the cache


def _unvalidated(**fields: Any) -> TenantPolicy:
    # model_construct() skips every validator: what a buggy caller could hand the store.
    return TenantPolicy.model_construct(**fields)


BAD_ENTRIES: list[tuple[str, Callable[[], TenantPolicy], str]] = [
    (
        "restricted and shared",
        lambda: _unvalidated(classification="restricted", reuse="tenant"),
        "restricted",
    ),
    ("negative ttl", lambda: _unvalidated(retention=Retention.model_construct(ttl_s=-1)), "ttl_s"),
    ("zero quota", lambda: _unvalidated(quota=Quota.model_construct(max_blocks=0)), "max_blocks"),
    (
        "unknown group",
        lambda: TenantPolicy(groups=("nope",)),
        "groups.0: names a share group share_groups lacks",
    ),
    (
        "idle over ttl",
        lambda: _unvalidated(retention=Retention.model_construct(idle_s=9, ttl_s=1)),
        "idle_s",
    ),
]


@pytest.mark.parametrize(("name", "entry", "message"), BAD_ENTRIES, ids=[b[0] for b in BAD_ENTRIES])
def test_a_bad_part_is_refused_by_parts_too(
    name: str, entry: Callable[[], TenantPolicy], message: str
) -> None:
    base = _reader(policy_set({"acme": {"retention": {"ttl_s": 60, "idle_s": 60}}}))
    edited = PolicySet.model_construct(
        version=1,
        epoch=0,
        default=base.default,
        tenants={**base.tenants, "beta": entry()},
        share_groups=base.share_groups,
    )
    assert checked_edit(edited, base, CanonicalParts()) is None
    with pytest.raises(PolicyValidationError, match=message):
        _reader(edited)


def test_a_bad_scalar_or_key_is_refused_by_parts_too() -> None:
    base = _reader(policy_set({"acme": {}}))
    for edited in (
        PolicySet.model_construct(**{**dict(base), "epoch": -1}),
        PolicySet.model_construct(**{**dict(base), "version": 2}),
        PolicySet.model_construct(**{**dict(base), "tenants": {"": base.tenants["acme"]}}),
        PolicySet.model_construct(**{**dict(base), "tenants": {"x" * 257: base.tenants["acme"]}}),
    ):
        assert checked_edit(edited, base, CanonicalParts()) is None


def test_an_equal_object_is_validated_again_identity_decides() -> None:
    base = _reader(policy_set({"acme": {}}))
    # Equal to the base's entry in every field, but never validated: it is parsed again.
    twin = TenantPolicy.model_construct(**dict(base.tenants["acme"]))
    edited = PolicySet.model_construct(**{**dict(base), "tenants": {"acme": twin}})
    checked = checked_edit(edited, base, CanonicalParts())
    assert checked is not None and checked.tenants["acme"] is not twin
    assert checked == base


# --- through the store -------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[PolicyStore]:
    store = PolicyStore.open(f"sqlite:///{tmp_path / 'policy.db'}")
    yield store
    store.engine.dispose()


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import kvguard.policy.store as store_module  # noqa: PLC0415

    parses: list[str] = []
    real = store_module.parse_policy

    def counting(text: str, source: str = "<string>", **kwargs: Any) -> PolicySet:
        parses.append(source)
        return real(text, source, **kwargs)

    monkeypatch.setattr(store_module, "parse_policy", counting)
    return parses


def _edit_entry(tenant: str, entry: TenantPolicy) -> Callable[[PolicyVersion | None], PolicySet]:
    def edit(current: PolicyVersion | None) -> PolicySet:
        assert current is not None
        return _with(current.policy, tenant, entry)

    return edit


def test_an_edit_of_a_stored_version_is_not_parsed_whole(
    store: PolicyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put(policy_set({f"t{i}": {} for i in range(8)}), author="alice", reason="r")
    parses = _count_parses(monkeypatch)
    entry = TenantPolicy(retention=Retention(ttl_s=30, idle_s=10))
    change = store.put_with(_edit_entry("t3", entry), author="bob", reason="tighten")
    assert parses == []  # only the new entry and the set's rules were validated
    fresh = PolicyStore(store.engine).get(change.version)  # another process reads it whole
    assert fresh.policy.tenants["t3"] == entry and fresh.change.digest == change.digest
    assert fresh.policy == store.get(change.version).policy


@pytest.mark.parametrize(("name", "entry", "message"), BAD_ENTRIES, ids=[b[0] for b in BAD_ENTRIES])
def test_the_store_refuses_a_bad_edit_of_a_validated_version(
    store: PolicyStore, name: str, entry: Callable[[], TenantPolicy], message: str
) -> None:
    store.put(policy_set({"acme": {}}), author="alice", reason="r")

    def edit(current: PolicyVersion | None) -> PolicySet:
        assert current is not None
        base = current.policy
        return PolicySet.model_construct(
            **{**dict(base), "tenants": {**base.tenants, "beta": entry()}}
        )

    with pytest.raises(PolicyValidationError, match=message):
        store.put_with(edit, author="mallory", reason="r")
    assert [c.version for c in store.history()] == [1]


def test_a_base_the_store_did_not_validate_is_parsed_whole(
    store: PolicyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put(policy_set({"acme": {}}), author="alice", reason="r")
    current = store.current()
    assert current is not None
    # A look-alike of the stored version whose parts were never validated: its parts do not
    # count as validated, however they compare.
    forged = PolicyVersion(
        change=current.change,
        policy=PolicySet.model_construct(
            **{
                **dict(current.policy),
                "default": _unvalidated(classification="confidential", reuse="public"),
            }
        ),
    )
    parses = _count_parses(monkeypatch)
    with pytest.raises(PolicyValidationError, match="confidential tenants may reuse at most"):
        store.validated_document(forged.policy, base=forged)
    assert parses == ["policy to store"]
