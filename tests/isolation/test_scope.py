from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvguard.isolation import Share


def test_session_share_requires_session_id(make_scope) -> None:
    with pytest.raises(ValidationError, match="session_id is required"):
        make_scope(share=Share.SESSION)


def test_group_share_requires_group_id(make_scope) -> None:
    with pytest.raises(ValidationError, match="group_id is required"):
        make_scope(share=Share.GROUP)


@pytest.mark.parametrize(
    ("share", "extra"),
    [
        (Share.TENANT, {"session_id": "s"}),
        (Share.TENANT, {"group_id": "g"}),
        (Share.PUBLIC, {"group_id": "g"}),
        (Share.SESSION, {"session_id": "s", "group_id": "g"}),
    ],
)
def test_fields_outside_the_share_are_refused(make_scope, share, extra) -> None:
    with pytest.raises(ValidationError, match="only allowed"):
        make_scope(share=share, **extra)


def test_scope_is_frozen_and_rejects_unknown_fields(make_scope) -> None:
    scope = make_scope()
    with pytest.raises(ValidationError):
        scope.tenant_id = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="cache_salt"):
        make_scope(cache_salt="client-chosen")


def test_empty_tenant_refused(make_scope) -> None:
    with pytest.raises(ValidationError, match="tenant_id"):
        make_scope(tenant_id="")


def test_with_share_and_same_domain(make_scope) -> None:
    a = make_scope(tenant_id="a").with_share(Share.GROUP, group_id="g")
    b = make_scope(tenant_id="b").with_share(Share.GROUP, group_id="g")
    assert a.same_domain(b)
    assert not make_scope(tenant_id="a").same_domain(make_scope(tenant_id="b"))
