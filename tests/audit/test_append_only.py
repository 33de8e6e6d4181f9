"""G5 at the database level: every statement that would change or remove history fails, on SQLite
(RAISE(ABORT) triggers) and PostgreSQL (row + TRUNCATE triggers, ENABLE ALWAYS, app role)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from kvguard.audit.ledger import Ledger
from kvguard.audit.roles import app_role_grants
from tests.dbs import pg_roles

from .conftest import make_event

Opener = Callable[..., Ledger]

FORBIDDEN = [
    "UPDATE ledger_entries SET kind = 'block.evict' WHERE idx = 1",
    "UPDATE ledger_entries SET leaf = leaf WHERE idx = 0",
    "DELETE FROM ledger_entries WHERE idx = 2",
    "DELETE FROM ledger_entries",
    "UPDATE ledger_entry_blocks SET block_id = 99999",
    "DELETE FROM ledger_entry_blocks",
    "UPDATE ledger_hashes SET hash = hash",
    "DELETE FROM ledger_hashes WHERE id > 0",
    "UPDATE ledger_checkpoints SET note = 'forged'",
    "DELETE FROM ledger_checkpoints",
    "UPDATE ledger_head SET size = size - 1",
    "UPDATE ledger_head SET size = 0",
    "DELETE FROM ledger_head",
    "UPDATE ledger_payloads SET body = body",
]
PG_ONLY = [
    f"TRUNCATE {t}"
    for t in (
        "ledger_entries",
        "ledger_entry_blocks",
        "ledger_hashes",
        "ledger_checkpoints",
        "ledger_head",
        "ledger_payloads",
    )
]


def _filled(open_ledger: Opener, url: str) -> Ledger:
    ledger = open_ledger(url)
    ledger.append_many([make_event(i) for i in range(10)])
    ledger.append(make_event(10, payload={"user": "carol"}))
    ledger.checkpoint()
    return ledger


def _refused(engine: sa.Engine, statement: str, setup: str | None = None) -> None:
    with engine.connect() as conn:
        if setup:
            conn.exec_driver_sql(setup)
        with pytest.raises(
            sa.exc.DBAPIError, match=r"forbidden|may only grow|head moves only|permission denied"
        ):
            conn.exec_driver_sql(statement)
        conn.rollback()


@pytest.mark.parametrize("statement", FORBIDDEN)
def test_G5_sqlite_triggers_refuse(statement: str, sqlite_url: str, open_ledger: Opener) -> None:
    ledger = _filled(open_ledger, sqlite_url)
    _refused(ledger.store.engine, statement)
    assert ledger.verify().size == 11


@pytest.mark.postgres
@pytest.mark.parametrize("statement", FORBIDDEN + PG_ONLY)
def test_G5_postgres_triggers_refuse(statement: str, pg_url: str, open_ledger: Opener) -> None:
    ledger = _filled(open_ledger, pg_url)
    _refused(ledger.store.engine, statement)
    # ENABLE ALWAYS: switching the session to replica mode (how logical replication and some
    # bulk loaders skip triggers) does not switch them off.
    _refused(ledger.store.engine, statement, setup="SET session_replication_role = replica")
    assert ledger.verify().size == 11


@pytest.mark.postgres
def test_G5_postgres_app_role_can_append_but_not_rewrite(pg_url: str, open_ledger: Opener) -> None:
    with pg_roles(pg_url) as (owner_url, app_url, app):
        owned = open_ledger(owner_url)
        with owned.store.engine.begin() as conn:
            for statement in app_role_grants(app):
                conn.exec_driver_sql(statement)
        ledger = open_ledger(app_url)
        ledger.append_many([make_event(i) for i in range(5)])
        ledger.append(make_event(5, payload={"user": "dave"}))
        ledger.checkpoint()
        ledger.erase_payload(5, reason="data_subject_request")
        for statement in [
            *FORBIDDEN,
            *PG_ONLY,
            "DROP TRIGGER ledger_entries_append_only ON ledger_entries",
            "ALTER TABLE ledger_entries DISABLE TRIGGER ALL",
        ]:
            with ledger.store.engine.connect() as conn, pytest.raises(sa.exc.DBAPIError):
                conn.exec_driver_sql(statement)
        assert ledger.verify().size == 7
        ledger.close()
        owned.close()


def test_app_role_grants_refuse_odd_role_names() -> None:
    with pytest.raises(ValueError):
        app_role_grants("app; DROP TABLE ledger_entries")
