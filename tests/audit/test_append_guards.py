"""Issue 12, item 4: the database itself keeps the log appendable and its head honest.

Each statement below is what a least-privilege app role (or anyone who can INSERT) could run to
brick the ledger before migration 0004: plant a row ahead of the head so that the next append
collides, or move the head so that every read and checkpoint fails. Each is refused, and afterwards
kvguard still appends, checkpoints and verifies. On PostgreSQL as the app role the grants of
`kvguard.audit.roles` prescribe; on SQLite (no roles) through the triggers alone.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvguard.audit.leaf import prepare_entry
from kvguard.audit.ledger import Ledger
from kvguard.audit.roles import app_role_grants
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError
from tests.dbs import pg_roles

from .conftest import make_event

Opener = Callable[..., Ledger]

_HEAD = "(SELECT size FROM ledger_head WHERE id = 1)"
# {blob}: a one-byte blob literal in the dialect's spelling
BRICKING = {
    "entry ahead of the head": "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
    f"SELECT {_HEAD} + 3, {{blob}}, {{blob}}, 'block.alloc', 0",
    "head raised": "UPDATE ledger_head SET size = size + 1",
    "head lowered": "UPDATE ledger_head SET size = size - 1",
    "checkpoint size raised": "UPDATE ledger_head SET checkpoint_size = size",
    "checkpoint size cleared": "UPDATE ledger_head SET checkpoint_size = NULL",
    "block link ahead": f"INSERT INTO ledger_entry_blocks (block_id, idx) SELECT 7, {_HEAD}",
    "command link ahead": f"INSERT INTO ledger_entry_commands (command_id, idx) SELECT 7, {_HEAD}",
    "payload ahead": f"INSERT INTO ledger_payloads (idx, salt, body) SELECT {_HEAD}, {{blob}}, "
    "{blob}",
    "subtree hash ahead": "INSERT INTO ledger_hashes (id, hash) "
    f"SELECT (1 * 281474976710656) + ({_HEAD} / 2) + 4, {{blob}}",
    "checkpoint beyond the log": "INSERT INTO ledger_checkpoints (size, root, note, prev_size) "
    f"SELECT {_HEAD} + 10, {{blob}}, 'forged', checkpoint_size FROM ledger_head",
    "checkpoint off the chain": "INSERT INTO ledger_checkpoints (size, root, note, prev_size) "
    f"SELECT {_HEAD}, {{blob}}, 'forged', NULL",
}
_REFUSED = r"head|appended entry|completes it|checkpoint is stored|permission denied"


def _blob(engine: sa.Engine) -> str:
    return "x'00'" if engine.dialect.name == "sqlite" else "'\\x00'::bytea"


def _filled(open_ledger: Opener, url: str) -> Ledger:
    ledger = open_ledger(url)
    ledger.append_many([make_event(i) for i in range(9)])
    ledger.checkpoint()
    ledger.append(make_event(9, payload={"user": "carol"}))
    return ledger


def _attempt(ledger: Ledger, statement: str) -> None:
    engine = ledger.store.engine
    with engine.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError, match=_REFUSED):
            conn.exec_driver_sql(statement.format(blob=_blob(engine)))
        conn.rollback()


def _still_works(ledger: Ledger, size: int) -> None:
    ledger.append_many([make_event(i) for i in range(size, size + 3)])
    ledger.checkpoint()
    assert ledger.verify().size == size + 3


# SQLite checks per row: block and command links (several per entry) are not checked there; the
# append path inserts them with INSERT OR IGNORE, so a planted one cannot collide (migration 0004).
_SQLITE_PLANTABLE = {"block link ahead", "command link ahead"}


@pytest.mark.parametrize("name", sorted(set(BRICKING) - _SQLITE_PLANTABLE))
def test_sqlite_refuses_each_bricking_statement(
    name: str, sqlite_url: str, open_ledger: Opener
) -> None:
    ledger = _filled(open_ledger, sqlite_url)
    _attempt(ledger, BRICKING[name])
    _still_works(ledger, 10)


@pytest.mark.parametrize("name", sorted(_SQLITE_PLANTABLE))
def test_sqlite_links_planted_ahead_cannot_stop_appends_and_are_reported(
    name: str, sqlite_url: str, open_ledger: Opener
) -> None:
    ledger = _filled(open_ledger, sqlite_url)
    with ledger.store.engine.begin() as conn:
        conn.exec_driver_sql(BRICKING[name].replace("SELECT 7,", "SELECT 50,"))
    ledger.append_many([make_event(i) for i in range(10, 13)])
    ledger.checkpoint()
    with pytest.raises(VerificationError, match=r"entry 10: (block|command) links do not match"):
        ledger.verify()


def test_an_insert_at_the_head_is_an_append_and_later_appends_go_on(
    sqlite_url: str, open_ledger: Opener
) -> None:
    """A row inserted at `idx = size` by someone else moves the head with it: kvguard's next append
    lands after it (no collision), rebuilds the subtree hashes that such a writer left out, and
    verification names the foreign entry instead of the log being stuck."""
    ledger = _filled(open_ledger, sqlite_url)
    with ledger.store.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
            f"SELECT {_HEAD}, x'00', x'00', 'block.alloc', 0"
        )
    assert ledger.size == 11
    first = ledger.append_many([make_event(i) for i in range(11, 16)])[0]
    assert first == 11
    with pytest.raises(VerificationError, match="entry 10"):
        ledger.verify()


@pytest.mark.postgres
def test_postgres_app_role_cannot_brick_the_ledger(pg_url: str, open_ledger: Opener) -> None:
    with pg_roles(pg_url) as (owner_url, app_url, app):
        owned = open_ledger(owner_url)
        with owned.store.engine.begin() as conn:
            for statement in app_role_grants(app):
                conn.exec_driver_sql(statement)
        ledger = _filled(open_ledger, app_url)
        size = 10
        for name in sorted(BRICKING):
            _attempt(ledger, BRICKING[name])
            _still_works(ledger, size)
            size += 3
        with (  # a leaf hash that is not the leaf's
            ledger.store.engine.connect() as conn,
            pytest.raises(sa.exc.DBAPIError, match="leaf hash"),
        ):
            conn.exec_driver_sql(
                "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
                f"SELECT {_HEAD}, '\\x00'::bytea, '\\x00'::bytea, 'block.alloc', 0"
            )
        ledger.close()
        owned.close()


@pytest.mark.postgres
def test_postgres_upgrade_takes_head_updates_from_roles_granted_before_0004(
    pg_url: str, open_ledger: Opener
) -> None:
    """A deployment that granted the app role `UPDATE (size, checkpoint_size)` (0.1.0's grants)
    loses it with the upgrade; the role keeps appending."""
    from alembic import command  # noqa: PLC0415

    from kvguard.audit.migrate import alembic_config  # noqa: PLC0415

    with pg_roles(pg_url) as (owner_url, app_url, app):
        engine = sa.create_engine(owner_url)
        cfg = alembic_config()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0003_entry_commands")
            for statement in app_role_grants(app):
                conn.exec_driver_sql(
                    statement.replace("UPDATE (id)", "UPDATE (size, checkpoint_size)")
                )
        engine.dispose()
        owned = open_ledger(owner_url)  # upgrades to 0004
        ledger = _filled(open_ledger, app_url)
        _attempt(ledger, BRICKING["head raised"])
        _still_works(ledger, 10)
        ledger.close()
        owned.close()


def test_errors_tell_a_wrong_origin_and_an_extra_row_from_tampering(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    ledger = _filled(open_ledger, sqlite_url)
    ledger.checkpoint()
    wrong = Ledger.open(sqlite_url, origin="log.kvguard.test/other", signing_key=key)
    try:
        with pytest.raises(VerificationError, match=r"not 'log\.kvguard\.test/other' \(the wrong"):
            wrong.verify()
        with pytest.raises(VerificationError, match=r"opened as 'log\.kvguard\.test/other'"):
            wrong.checkpoint()
    finally:
        wrong.close()
    raw = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    raw.execute("DROP TRIGGER ledger_entries_at_head")  # someone with DDL rights
    raw.execute("DROP TRIGGER ledger_entries_advance")
    p = prepare_entry(make_event(99, block_ids=[]))
    raw.execute(
        "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, scope_tag, request_id, ts_us) "
        "SELECT size, ?, ?, ?, ?, ?, ? FROM ledger_head",
        (p.leaf, p.leaf_hash, p.kind, p.scope_tag, p.request_id, p.ts_us),
    )
    raw.close()
    with pytest.raises(VerificationError, match=r"entries 10\.\.10: 1 extra row\(s\) beyond"):
        ledger.verify()
