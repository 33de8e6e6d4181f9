"""Append guards: rows enter the ledger only at the head, and the head moves only with them.

Issue 12, item 4. Before this revision the app role (which must INSERT to append) could brick the
log: one INSERT at `idx = head.size` without moving the head made every later append collide on
the primary key, one UPDATE raising `size` or `checkpoint_size` made every read and checkpoint
fail, and the append-only triggers then blocked the repair. Now, in the database itself:

- an entry is inserted only at `idx = head.size`, and inserting it advances the head (a trigger
  does it: the application no longer writes `ledger_head.size`); on PostgreSQL its leaf hash must
  also be RFC 6962's hash of its leaf (SQLite has no SHA-256 function; `verify-db` checks it);
- block links, command links and payloads are inserted only for entries already in the log, and a
  stored subtree hash only for a subtree the log has completed (nothing can be planted ahead of the
  head to collide with a later append; on SQLite, where triggers run per row, block and command
  links are not checked but the append path inserts them with `INSERT OR IGNORE`, so a planted
  link cannot collide either and `verify()` reports it);
- a checkpoint row is inserted only at a size within the log, above the latest checkpoint and
  chained to it (`prev_size`), and inserting it moves `checkpoint_size` (a trigger again);
- the head row accepts no other change: its `size` must equal the number of entries and its
  `checkpoint_size` the latest checkpoint row.

PostgreSQL: the advancing triggers are `SECURITY DEFINER` functions of the owner, and the upgrade
revokes UPDATE on `ledger_head` from every other role, so the app role cannot move the head at all
(`kvguard.audit.roles` no longer grants it). Entries and the other tables are checked per
statement (transition tables: the app's `COPY` fires one check per table, not one per row).
SQLite has no roles: the triggers are the guard, per row.

What this does not stop: an app role can still append a well-formed but false entry (it is the
writer), and a role with DDL rights can drop the triggers. Checkpoints pinned by auditors and
cosigned by witnesses (docs/audit.md) are the answer to those.

Revision ID: 0004_append_guards
Revises: 0003_entry_commands
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from alembic import op

revision = "0004_append_guards"
down_revision = "0003_entry_commands"
branch_labels = None
depends_on = None

_LINKED: Final = ("ledger_entry_blocks", "ledger_entry_commands", "ledger_payloads")
# SQLite checks per row, and block and command links are several per entry: there the append path
# inserts them with `INSERT OR IGNORE` instead (a link planted ahead cannot collide with the
# append; `verify()` names it as a link that no leaf holds). Payloads are few: checked.
_SQLITE_LINKED: Final = ("ledger_payloads",)
_KEY_BITS: Final = 48  # `merkle.stored_hash_key`: level << 48 | index
_INDEX_MASK: Final = (1 << _KEY_BITS) - 1


def _abort(message: str) -> str:
    return f"SELECT RAISE(ABORT, 'kvguard ledger: {message}')"


def _sqlite() -> None:
    head = "(SELECT size FROM ledger_head WHERE id = 1)"
    cp_head = "(SELECT checkpoint_size FROM ledger_head WHERE id = 1)"
    op.execute("DROP TRIGGER IF EXISTS ledger_head_no_shrink")
    statements = [
        f"CREATE TRIGGER ledger_entries_at_head BEFORE INSERT ON ledger_entries "
        f"WHEN NEW.idx IS NOT {head} "
        f"BEGIN {_abort('an entry is appended only at the head index')}; END",
        "CREATE TRIGGER ledger_entries_advance AFTER INSERT ON ledger_entries "
        "BEGIN UPDATE ledger_head SET size = NEW.idx + 1 WHERE id = 1; END",
        # One guard per column, so that the per-entry head advance evaluates one subquery.
        "CREATE TRIGGER ledger_head_size_guard BEFORE UPDATE OF size ON ledger_head "  # noqa: S608
        "WHEN NEW.size IS NOT (SELECT COALESCE(MAX(idx), -1) + 1 FROM ledger_entries) "
        f"BEGIN {_abort('the head moves only with appended entries')}; END",
        "CREATE TRIGGER ledger_head_checkpoint_guard BEFORE UPDATE OF checkpoint_size "  # noqa: S608
        "ON ledger_head WHEN NEW.checkpoint_size IS NOT (SELECT MAX(size) FROM ledger_checkpoints) "
        f"BEGIN {_abort('the head moves its checkpoint only with a stored checkpoint')}; END",
        "CREATE TRIGGER ledger_head_id_guard BEFORE UPDATE OF id ON ledger_head "
        "WHEN NEW.id IS NOT OLD.id "
        f"BEGIN {_abort('the head moves only with appended entries and checkpoints')}; END",
        f"CREATE TRIGGER ledger_hashes_complete BEFORE INSERT ON ledger_hashes "
        f"WHEN (NEW.id >> {_KEY_BITS}) < 1 OR (NEW.id >> {_KEY_BITS}) > {_KEY_BITS} "
        f"OR (((NEW.id & {_INDEX_MASK}) + 1) << (NEW.id >> {_KEY_BITS})) > {head} "
        f"BEGIN {_abort('a subtree hash is stored only once the log completes it')}; END",
        f"CREATE TRIGGER ledger_checkpoints_at_head BEFORE INSERT ON ledger_checkpoints "
        f"WHEN NEW.size > {head} OR NEW.size <= COALESCE({cp_head}, -1) "
        f"OR NEW.prev_size IS NOT {cp_head} "
        f"BEGIN {_abort('a checkpoint is stored only above the last one, within the log')}; END",
        "CREATE TRIGGER ledger_checkpoints_advance AFTER INSERT ON ledger_checkpoints "
        "BEGIN UPDATE ledger_head SET checkpoint_size = NEW.size WHERE id = 1; END",
    ]
    statements += [
        f"CREATE TRIGGER {table}_of_entries BEFORE INSERT ON {table} "
        f"WHEN NEW.idx >= {head} "
        f"BEGIN {_abort(f'a row of {table} must belong to an appended entry')}; END"
        for table in _SQLITE_LINKED
    ]
    for statement in statements:
        op.execute(statement)


_PG_FUNCTIONS: Final = """
CREATE OR REPLACE FUNCTION ledger_entries_appended() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
DECLARE lo bigint; hi bigint; n bigint; cur bigint;
BEGIN
  SELECT min(idx), max(idx), count(*) INTO lo, hi, n FROM appended;
  IF n = 0 THEN RETURN NULL; END IF;
  SELECT size INTO cur FROM ledger_head WHERE id = 1 FOR UPDATE;
  IF lo <> cur OR hi - lo + 1 <> n THEN
    RAISE EXCEPTION 'kvguard ledger: an entry is appended only at the head index (%)', cur
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  IF EXISTS (SELECT 1 FROM appended
             WHERE leaf_hash <> sha256(decode('00', 'hex') || leaf)) THEN
    RAISE EXCEPTION 'kvguard ledger: an entry''s leaf hash must be RFC 6962''s hash of its leaf'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  UPDATE ledger_head SET size = hi + 1 WHERE id = 1;
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION ledger_rows_of_entries() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM appended WHERE idx >= (SELECT size FROM ledger_head WHERE id = 1)) THEN
    RAISE EXCEPTION 'kvguard ledger: a row of % must belong to an appended entry', TG_TABLE_NAME
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION ledger_hashes_complete() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
BEGIN
  IF EXISTS (SELECT 1 FROM appended WHERE (id >> {bits}) < 1 OR (id >> {bits}) > {bits}
             OR (((id & {mask}) + 1) << (id >> {bits})::int)
                > (SELECT size FROM ledger_head WHERE id = 1)) THEN
    RAISE EXCEPTION 'kvguard ledger: a subtree hash is stored only once the log completes it'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION ledger_checkpoint_stored() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
DECLARE cur bigint; cp bigint;
BEGIN
  SELECT size, checkpoint_size INTO cur, cp FROM ledger_head WHERE id = 1 FOR UPDATE;
  IF NEW.size > cur OR NEW.size <= COALESCE(cp, -1) OR NEW.prev_size IS DISTINCT FROM cp THEN
    RAISE EXCEPTION 'kvguard ledger: a checkpoint is stored only above the last one, within the log'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  UPDATE ledger_head SET checkpoint_size = NEW.size WHERE id = 1;
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION ledger_head_guard() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
BEGIN
  IF TG_OP <> 'UPDATE' OR NEW.id <> OLD.id
     OR NEW.size IS DISTINCT FROM (SELECT COALESCE(max(idx), -1) + 1 FROM ledger_entries)
     OR NEW.checkpoint_size IS DISTINCT FROM (SELECT max(size) FROM ledger_checkpoints) THEN
    RAISE EXCEPTION 'kvguard ledger: the head moves only with appended entries and checkpoints'
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END $$;
"""


def _pg_trigger(name: str, table: str, spec: str) -> None:
    op.execute(f"CREATE TRIGGER {name} {spec.format(t=table)}")
    # ENABLE ALWAYS: the trigger fires even under session_replication_role = replica.
    op.execute(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {name}")


def _postgresql(conn: sa.Connection) -> None:
    schema = conn.exec_driver_sql("SELECT quote_ident(current_schema())").scalar_one()
    op.execute(_PG_FUNCTIONS.format(schema=schema, bits=_KEY_BITS, mask=_INDEX_MASK))
    per_statement = "AFTER INSERT ON {t} REFERENCING NEW TABLE AS appended FOR EACH STATEMENT"
    _pg_trigger(
        "ledger_entries_appended",
        "ledger_entries",
        f"{per_statement} EXECUTE FUNCTION ledger_entries_appended()",
    )
    _pg_trigger(
        "ledger_hashes_complete",
        "ledger_hashes",
        f"{per_statement} EXECUTE FUNCTION ledger_hashes_complete()",
    )
    for table in _LINKED:
        _pg_trigger(
            f"{table}_of_entries",
            table,
            f"{per_statement} EXECUTE FUNCTION ledger_rows_of_entries()",
        )
    _pg_trigger(
        "ledger_checkpoint_stored",
        "ledger_checkpoints",
        "AFTER INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION ledger_checkpoint_stored()",
    )
    # 0001's `ledger_head_grow_only` now runs the stricter guard (same function name). Nobody but
    # the owner moves the head any more (the triggers above do, as the owner): every other role
    # that could update it keeps only UPDATE (id), which `SELECT ... FOR UPDATE` needs to lock the
    # row and which the guard makes useless (the id never changes).
    grantees = conn.execute(
        sa.text(
            "SELECT DISTINCT CASE WHEN grantee = 'PUBLIC' THEN grantee ELSE quote_ident(grantee) END "
            "FROM information_schema.column_privileges "
            "WHERE table_schema = current_schema() AND table_name = 'ledger_head' "
            "AND privilege_type = 'UPDATE' AND grantee <> (SELECT pg_get_userbyid(relowner) "
            "FROM pg_class WHERE oid = 'ledger_head'::regclass)"
        )
    ).scalars()
    for grantee in grantees:
        op.execute(f"REVOKE UPDATE ON ledger_head FROM {grantee}")
        if grantee != "PUBLIC":
            op.execute(f"GRANT UPDATE (id) ON ledger_head TO {grantee}")


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        _postgresql(conn)
    else:
        _sqlite()


def downgrade() -> None:
    raise RuntimeError("the audit ledger is append-only: its schema is never downgraded")
