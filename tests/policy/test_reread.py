"""A stored version read as an edit of one this process holds (`kvguard.policy.edits.reread`): the
same set a reader's whole parse gives, or None (then the caller parses it whole), never anything
else, whatever the stored text; and the store reads another process's versions that way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.errors import PolicyValidationError
from kvguard.policy import PolicySet, PolicyStore, TenantPolicy
from kvguard.policy.edits import CanonicalParts, reread
from kvguard.policy.loading import parse_policy
from kvguard.policy.models import Retention
from kvguard.policy.store import PolicyChange, PolicyVersion
from tests.dbs import fresh_pg_database
from tests.policy.conftest import policy_set
from tests.policy.test_decisions_properties import policy_sets, tenant_policies
from tests.policy.test_edits import _count_parses

TENANT_IDS = st.sampled_from(["a", "b", "c", "d", "a-b@c:d_e", "Z", "a.b", "b0", "zz"])


def _parse(text: str) -> PolicySet:
    return parse_policy(text, "test", fmt="json")


def _document(data: dict[str, Any]) -> str:
    """The canonical text of a set given as plain data."""
    return PolicySet.model_validate(data).canonical_json()


def _oracle(text: str, base: PolicySet, parts: CanonicalParts) -> PolicySet | None:
    """reread's answer, checked against the whole parse: equal (with the reader's tenant order),
    or None; None whenever the whole parse refuses the text."""
    result = reread(text, base, parts)
    try:
        full = _parse(text)
    except PolicyValidationError:
        assert result is None
        return None
    if result is not None:
        assert result == full
        assert list(result.tenants) == list(full.tenants)  # the reader's order of both maps
        assert list(result.share_groups) == list(full.share_groups)
        assert result.model_dump_json() == full.model_dump_json()
    return result


# Edits: (tenant, entry) sets an entry, (tenant, None) removes it.
EDITS = st.lists(st.tuples(TENANT_IDS, st.none() | tenant_policies()), min_size=1, max_size=6)


def _apply(data: dict[str, Any], edits: list[tuple[str, dict[str, Any] | None]]) -> dict[str, Any]:
    tenants = dict(data["tenants"])
    for tenant, entry in edits:
        if entry is None:
            tenants.pop(tenant, None)
        else:
            tenants[tenant] = entry
    return {**data, "tenants": tenants}


@settings(max_examples=200, deadline=None)
@given(policy_sets(), EDITS)
def test_tenant_edits_are_reread_to_what_a_reader_parses(
    generated: PolicySet, edits: list[tuple[str, dict[str, Any] | None]]
) -> None:
    base = _parse(generated.canonical_json())
    data = json.loads(generated.canonical_json())
    text = _document(_apply(data, edits))
    parts = CanonicalParts()
    result = _oracle(text, base, parts)
    assert result is not None  # tenant edits alone never need a whole parse
    for key, part in result.tenants.items():
        if key in base.tenants and parts.fragment(base.tenants[key]) == parts.fragment(part):
            assert part is base.tenants[key]  # unchanged entries are the base's own objects


@settings(max_examples=100, deadline=None)
@given(policy_sets(), st.integers(0, 3), st.sampled_from(["none", "session", "tenant"]))
def test_changes_outside_the_tenants_are_parsed_whole(
    generated: PolicySet, epoch: int, default_reuse: str
) -> None:
    base = _parse(generated.canonical_json())
    data = json.loads(generated.canonical_json())
    text = _document({**data, "epoch": epoch, "default": {"reuse": default_reuse}})
    result = _oracle(text, base, CanonicalParts())
    if text != generated.canonical_json():
        assert result is None


BASE = _parse(
    policy_set(
        {f"t{i:02d}": {"retention": {"ttl_s": 3000 + i, "idle_s": 300}} for i in range(12)}
    ).canonical_json()
)
BASE_TEXT = BASE.canonical_json()


ENTRY_OF_T05 = json.dumps(
    json.loads(BASE_TEXT)["tenants"]["t05"], sort_keys=True, separators=(",", ":")
)
ITEM = '"t05":' + ENTRY_OF_T05


def _edited(old: str, new: str) -> str:
    """The base's text with `old` replaced by `new` inside tenant t05's item only."""
    assert BASE_TEXT.count(ITEM) == 1 and ITEM.count(old) == 1, old
    return BASE_TEXT.replace(ITEM, ITEM.replace(old, new))


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("whitespace in an entry", _edited('"ttl_s":3005', '"ttl_s": 3005')),
        ("a nested key twice", _edited('"ttl_s":3005', '"ttl_s":3005,"ttl_s":3004')),
        ("a tenant twice", _edited('"t05":{', '"t05":' + ENTRY_OF_T05 + ',"t05":{')),
        ("a tenant twice, apart", _edited('"t05":{', '"t11":' + ENTRY_OF_T05 + ',"t05":{')),
        ("NaN", _edited('"ttl_s":3005', '"ttl_s":NaN')),
        ("a float", _edited('"ttl_s":3005', '"ttl_s":3005.0')),
        ("a huge integer", _edited('"ttl_s":3005', '"ttl_s":' + "9" * 5000)),
        (
            "restricted and shared",
            _edited('"classification":"internal"', '"classification":"restricted"'),
        ),
        ("idle over ttl", _edited('"ttl_s":3005', '"ttl_s":1')),
        ("an unknown field", _edited('"t05":{', '"t05":{"extra":1,')),
        (
            "an unknown group",
            _edited(
                '"groups":[]',
                '"groups":["nope"]',
            ),
        ),
        ("an empty key", _edited('"t05":{', '"":{')),
        ("keys out of order", _edited('"t05":{', '"t99":{')),
        ("a truncated entry", _edited(ENTRY_OF_T05, "")),
        ("a nested array deep", _edited('"groups":[]', '"groups":' + "[" * 3000 + "]" * 3000)),
        ("an extra top-level key", BASE_TEXT[:-1] + ',"x":1}'),
        ("the version", BASE_TEXT.replace('"version":1}', '"version":2}')),
    ],
)
def test_a_bad_or_odd_text_is_never_read_as_something_else(name: str, text: str) -> None:
    assert text != BASE_TEXT
    _oracle(text, BASE, CanonicalParts())


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_random_change_of_the_text_is_reread_right_or_not_at_all(data: st.DataObject) -> None:
    text = BASE_TEXT
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 8))
        insert = data.draw(st.text(alphabet='{}[]:,"0123456789tabnul .-e', max_size=8))
        text = text[:at] + insert + text[at + cut :]
    _oracle(text, BASE, CanonicalParts())


def _out_of_order(policy: PolicySet) -> str:
    """`policy`'s canonical text with both maps in reverse key order: what an old or hand-made row
    can hold (a reader parses it to the same set, its maps in that order)."""
    data = json.loads(policy.canonical_json())
    data["tenants"] = dict(reversed(data["tenants"].items()))
    data["share_groups"] = dict(reversed(data["share_groups"].items()))
    return json.dumps(data)


@settings(max_examples=100, deadline=None)
@given(policy_sets(), EDITS)
def test_a_base_parsed_from_a_text_in_another_order_gives_the_readers_order(
    generated: PolicySet, edits: list[tuple[str, dict[str, Any] | None]]
) -> None:
    base = _parse(_out_of_order(generated))
    data = json.loads(generated.canonical_json())
    for text in (generated.canonical_json(), _document(_apply(data, edits))):
        _oracle(text, base, CanonicalParts())  # checks both maps' order, not only equality


def test_an_unchanged_text_is_the_base_itself() -> None:
    assert reread(BASE_TEXT, BASE, CanonicalParts()) is BASE


def test_a_base_with_unknown_fields_is_not_used() -> None:
    odd = PolicySet.model_construct(**{**dict(BASE), "epoch": True})  # not a plain int
    assert reread(BASE_TEXT, odd, CanonicalParts()) is None


# --- through the store: another process's versions ------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[PolicyStore, PolicyStore]]:
    with ExitStack() as stack:
        url = (
            f"sqlite:///{tmp_path / 'policy.db'}"
            if request.param == "sqlite"
            else stack.enter_context(fresh_pg_database("kvg_reread"))
        )
        writer, reader = PolicyStore.open(url), PolicyStore.open(url)
        yield writer, reader
        writer.engine.dispose()
        reader.engine.dispose()


def _set_entry(tenant: str, entry: TenantPolicy | None) -> Any:
    def edit(current: Any) -> PolicySet:
        base = current.policy
        tenants = {k: v for k, v in base.tenants.items() if k != tenant}
        if entry is not None:
            tenants[tenant] = entry
        return PolicySet.model_validate({**dict(base), "tenants": tenants})

    return edit


def test_another_process_s_versions_are_read_without_a_whole_parse(
    stores: tuple[PolicyStore, PolicyStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = stores
    writer.put(policy_set({f"t{i:02d}": {} for i in range(40)}), author="alice", reason="r")
    first = reader.current()  # parsed whole: the reader holds no version yet
    assert first is not None
    parses = _count_parses(monkeypatch)
    changes = []
    for n in range(30):
        entry = None if n % 7 == 3 else TenantPolicy(retention=Retention(ttl_s=100 + n, idle_s=10))
        changes.append(
            writer.put_with(_set_entry(f"t{(n * 13) % 45:02d}", entry), author="bob", reason="r")
        )
        if n % 3 == 0:  # the reader falls a few versions behind, then catches up
            continue
        current = reader.current()
        assert current is not None and current.change == changes[-1]
    assert parses == []
    for change in changes:  # every version equals a whole parse of its stored text
        read = reader.get(change.version)
        assert read.policy == PolicyStore(writer.engine).get(change.version).policy


def test_a_version_that_differs_outside_the_tenants_is_parsed_whole(
    stores: tuple[PolicyStore, PolicyStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = stores
    writer.put(policy_set({"acme": {}}), author="alice", reason="r")
    assert reader.current() is not None
    parses = _count_parses(monkeypatch)
    change = writer.put(policy_set({"acme": {}}, epoch=1), author="alice", reason="epoch")
    current = reader.current()
    assert current is not None and current.change.version == change
    assert current.policy.epoch == 1
    assert parses == [f"policy store version {change}"]


def test_a_tenants_limits_are_kept_per_version_and_digest(
    stores: tuple[PolicyStore, PolicyStore],
) -> None:
    """A version number can be taken by a write that rolls back and then by another with other
    content: the limits kept for the first are never those of the second."""
    writer, _ = stores
    gone = PolicyVersion(
        change=PolicyChange(version=1, author="a", reason="r", digest="sha256:" + "0" * 64, at=0.0),
        policy=policy_set({"acme": {"retention": {"ttl_s": 9000, "idle_s": 600}}}),
    )
    writer.remember_limit("acme", gone)  # as if version 1 had been this, then rolled back
    tight = policy_set({"acme": {"retention": {"ttl_s": 100, "idle_s": 60}}})
    writer.put(tight, author="admin", reason="r", limits_of="acme")
    limit = writer.tenant_limit("acme", 0, 1)
    assert limit is not None and limit.retention.ttl_s == 100
    assert writer.tenant_limit("beta", 0, 1) is None  # another tenant's limits are not acme's
