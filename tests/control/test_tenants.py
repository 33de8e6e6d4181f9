"""`TenantRegistry.require`: an id found registered is answered without a read afterwards, an id
not found is read every time (and never remembered), and `get` always reads the row."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from kvguard.control.db import open_engine
from kvguard.control.tenants import TenantRegistry
from kvguard.errors import NotFoundError


@contextmanager
def _counted(engine: sa.Engine) -> Iterator[list[str]]:
    """The statements `engine` sends while the block runs."""
    sent: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)


def test_require_reads_a_tenant_once_and_never_remembers_a_missing_one(db_url: str) -> None:
    engine = open_engine(db_url)
    try:
        tenants = TenantRegistry(engine)
        tenants.create("acme", display_name="Acme", created_by="test")
        assert not tenants.is_registered("acme")  # created is not read: nothing remembered yet
        with _counted(engine) as sent:
            tenants.require("acme")
        assert any("tenants" in s for s in sent)
        assert tenants.is_registered("acme")
        with _counted(engine) as sent:
            tenants.require("acme")
        assert sent == []
        for _ in range(2):  # a missing id is read (and refused) every time
            with _counted(engine) as sent, pytest.raises(NotFoundError):
                tenants.require("nobody")
            assert sent and not tenants.is_registered("nobody")
        # Registered later (here by another registry, as another process would): found then.
        TenantRegistry(engine).create("nobody", display_name="", created_by="test")
        tenants.require("nobody")
        assert tenants.is_registered("nobody")
    finally:
        engine.dispose()


def test_get_reads_the_row_even_for_a_registered_tenant(db_url: str) -> None:
    engine = open_engine(db_url)
    try:
        tenants = TenantRegistry(engine)
        tenants.create("acme", display_name="Acme", created_by="test")
        tenants.require("acme")
        TenantRegistry(engine).disable("acme", by="other", reason="ended")
        tenant = tenants.get("acme")
        assert not tenant.enabled and tenant.disabled_by == "other"
    finally:
        engine.dispose()
