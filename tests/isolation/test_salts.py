"""G1 / G6: salts are server-derived, scoped, keyed and rotate; tags are opaque pseudonyms."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
from hypothesis import given, settings

from kvguard.errors import UntrustedSaltError
from kvguard.isolation import (
    AdapterRef,
    CacheConfig,
    Keyring,
    ModelRef,
    SaltDeriver,
    Scope,
    Share,
    TokenizerRef,
    encode_scope,
)
from tests.isolation.conftest import scopes

KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))


@pytest.fixture
def deriver() -> SaltDeriver:
    return SaltDeriver(Keyring({"k1": KEY_A}, active="k1"))


def test_salt_matches_the_documented_construction(deriver, make_scope) -> None:
    scope = make_scope()
    mac = hmac.new(KEY_A, b"kvguard/salt/v1" + encode_scope(scope), hashlib.sha256).digest()
    expected = "k1:" + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    assert deriver.salt(scope) == expected


def test_same_scope_same_salt_and_cache_is_consistent(deriver, make_scope) -> None:
    assert deriver.salt(make_scope()) == deriver.salt(make_scope())
    fresh = SaltDeriver(Keyring({"k1": KEY_A}, active="k1"))
    assert fresh.salt(make_scope()) == deriver.salt(make_scope())


@pytest.mark.parametrize(
    "change",
    [
        {"tenant_id": "globex"},
        {"share": Share.SESSION, "session_id": "s1"},
        {"share": Share.GROUP, "group_id": "g1"},
        {"share": Share.PUBLIC},
        {"model": ModelRef(id="meta-llama/Llama-3-8B", revision="r2")},
        {"model": ModelRef(id="meta-llama/Llama-3-8B", revision="r1", weights_digest="sha256:00")},
        {"model": ModelRef(id="other", revision="r1")},
        {"tokenizer": TokenizerRef(id="meta-llama/Llama-3-8B", revision="r2")},
        {"adapter": AdapterRef(id="lora-a", revision="1")},
        {"cache_config": CacheConfig(kv_dtype="fp8_e4m3", block_size=16)},
        {"cache_config": CacheConfig(kv_dtype="bf16", block_size=32)},
        {"cache_config": CacheConfig(kv_dtype="bf16", block_size=16, quantization="int4")},
        {"policy_epoch": 1},
    ],
)
def test_G1_any_domain_field_change_changes_the_salt(deriver, make_scope, change) -> None:
    assert deriver.salt(make_scope(**change)) != deriver.salt(make_scope())
    assert deriver.scope_tag(make_scope(**change)) != deriver.scope_tag(make_scope())


def test_G1_policy_epoch_bump_invalidates_every_salt(deriver, make_scope) -> None:
    tenants = [f"t{i}" for i in range(50)]
    before = {deriver.salt(make_scope(tenant_id=t)) for t in tenants}
    after = {deriver.salt(make_scope(tenant_id=t, policy_epoch=1)) for t in tenants}
    assert len(before) == 50
    assert not before & after


def test_different_secret_different_salt(make_scope) -> None:
    a = SaltDeriver(Keyring({"k1": KEY_A}, active="k1"))
    b = SaltDeriver(Keyring({"k1": KEY_B}, active="k1"))
    assert a.salt(make_scope()) != b.salt(make_scope())
    assert a.scope_tag(make_scope()) != b.scope_tag(make_scope())


def test_rotation_uses_new_key_and_keeps_tags(make_scope) -> None:
    ring = Keyring({"k1": KEY_A}, active="k1")
    old, new = SaltDeriver(ring), SaltDeriver(ring.rotated("k2", KEY_B))
    assert new.salt(make_scope()).startswith("k2:")
    assert new.salt(make_scope()) != old.salt(make_scope())
    # Pseudonyms are pinned to the tag key so audit queries work across rotations.
    assert new.scope_tag(make_scope()) == old.scope_tag(make_scope())
    assert new.tenant_tag("acme") == old.tenant_tag("acme")


@settings(max_examples=200)
@given(scopes())
def test_G6_salt_and_tag_reveal_nothing_of_the_scope(scope: Scope) -> None:
    d = SaltDeriver(Keyring({"k1": KEY_A}, active="k1"))
    salt, tag, ttag = d.salt(scope), d.scope_tag(scope), d.tenant_tag(scope.tenant_id)
    body = salt.split(":", 1)[1]
    assert len(body) == 43  # exactly one SHA-256 MAC, base64url without padding
    assert set(body) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    for secret_ish in (salt, tag, ttag):
        if len(scope.tenant_id) >= 4:
            assert scope.tenant_id not in secret_ish
        assert KEY_A.hex() not in secret_ish
    assert tag.startswith("st_") and ttag.startswith("tt_")
    assert tag[3:] not in salt  # the tag is not a prefix/slice of the salt


def test_tags_use_separate_labels(deriver, make_scope) -> None:
    scope = make_scope()
    assert deriver.scope_tag(scope)[3:] not in deriver.salt(scope)


def test_G1_client_supplied_salt_refused(deriver) -> None:
    deriver.check_not_client_salt(None)
    with pytest.raises(UntrustedSaltError) as info:
        deriver.check_not_client_salt("k1:forged")
    assert "forged" not in str(info.value)
