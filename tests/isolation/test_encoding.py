"""G1: the scope encoding is injective over reuse domains."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.isolation import AdapterRef, Share, encode_scope, encode_tenant
from kvguard.isolation.scope import Scope
from tests.isolation.conftest import scopes


def domain(scope: Scope) -> tuple[object, ...]:
    """The reuse domain spelled out field by field, independent of the encoder under test."""
    in_tenant = scope.share in (Share.SESSION, Share.TENANT)
    return (
        scope.share,
        scope.tenant_id if in_tenant else None,
        scope.session_id,
        scope.group_id,
        scope.model,
        scope.tokenizer,
        scope.adapter,
        scope.cache_config,
        scope.policy_epoch,
    )


@settings(max_examples=600)
@given(scopes(), scopes())
def test_G1_distinct_domains_never_encode_alike(a: Scope, b: Scope) -> None:
    assert (encode_scope(a) == encode_scope(b)) == (domain(a) == domain(b))


@given(scopes())
def test_encoding_is_deterministic(a: Scope) -> None:
    again = Scope.model_validate(a.model_dump())
    assert encode_scope(a) == encode_scope(again)


def test_G1_adapter_name_cannot_collide_with_other_fields(make_scope) -> None:
    # vLLM issue 44701 shape: a LoRA name equal to another key part must not collide.
    base = make_scope()
    with_adapter = make_scope(adapter=AdapterRef(id="acme", revision="r1"))
    other_tenant = make_scope(tenant_id="acme|acme")
    assert len({encode_scope(base), encode_scope(with_adapter), encode_scope(other_tenant)}) == 3


def test_separators_inside_values_do_not_shift_fields(make_scope) -> None:
    a = make_scope(tenant_id="a|b", share=Share.SESSION, session_id="c")
    b = make_scope(tenant_id="a", share=Share.SESSION, session_id="b|c")
    c = make_scope(tenant_id="a\x00b", share=Share.SESSION, session_id="c")
    d = make_scope(tenant_id="a", share=Share.SESSION, session_id="b\x00c")
    assert len({encode_scope(s) for s in (a, b, c, d)}) == 4


def test_group_and_public_share_drop_the_tenant(make_scope) -> None:
    g1 = make_scope(tenant_id="a", share=Share.GROUP, group_id="g")
    g2 = make_scope(tenant_id="b", share=Share.GROUP, group_id="g")
    p1 = make_scope(tenant_id="a", share=Share.PUBLIC)
    p2 = make_scope(tenant_id="b", share=Share.PUBLIC)
    assert encode_scope(g1) == encode_scope(g2)
    assert encode_scope(p1) == encode_scope(p2)
    assert encode_scope(g1) != encode_scope(p1)


@given(st.text(), st.text())
def test_tenant_encoding_injective_and_distinct_from_scopes(a: str, b: str) -> None:
    assert (encode_tenant(a) == encode_tenant(b)) == (a == b)
    assert not encode_tenant(a).startswith(b"KVGS")
