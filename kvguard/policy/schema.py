"""The policy store's tables (own MetaData, names prefixed `policy_`) and their append-only guards.

`policy_versions` is history: the database itself refuses UPDATE, DELETE and TRUNCATE on it, so
"never update in place" does not rest on the store's code alone. `policy_head` holds the latest version
number; it may only step forward by one (which is what `put` does under its row lock) and never be
deleted. The guards are created together with the tables (SQLAlchemy `after_create` events), so a
database made by `create_all` is never without them.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import DDL, BigInteger, Double, MetaData, String, Text, event
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

HEAD_ID: Final = 1
AUTHOR_MAX: Final = 256
REASON_MAX: Final = 2000


class PolicyBase(DeclarativeBase):
    metadata = MetaData()


class PolicyHead(PolicyBase):
    """The single row whose lock serializes writers and whose value is the latest version."""

    __tablename__ = "policy_head"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(BigInteger)


class PolicyVersionRow(PolicyBase):
    """One stored version: who, when, why, and the canonical JSON with its digest."""

    __tablename__ = "policy_versions"
    version: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    created_at: Mapped[float] = mapped_column(Double)  # seconds on the store's clock (UNIX time)
    author: Mapped[str] = mapped_column(String(AUTHOR_MAX))
    reason: Mapped[str] = mapped_column(String(REASON_MAX))
    digest: Mapped[str] = mapped_column(String(71))
    document: Mapped[str] = mapped_column(Text)


def _ddl(statement: str, dialect: str) -> DDL:
    # DDL text goes through Python %-formatting: a literal % (in plpgsql RAISE) is written %%.
    return DDL(statement).execute_if(dialect=dialect)  # type: ignore[no-untyped-call]


def _sqlite_trigger(name: str, when: str, table: str, guard: str = "") -> DDL:
    return _ddl(
        f"CREATE TRIGGER {name} BEFORE {when} ON {table} {guard} BEGIN "
        f"SELECT RAISE(ABORT, 'kvguard policy: {when} on {table} is forbidden'); END",
        "sqlite",
    )


_PG_FORBID: Final = """
CREATE OR REPLACE FUNCTION policy_forbid() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'kvguard policy: %% on %% is forbidden', TG_OP, TG_TABLE_NAME
    USING ERRCODE = 'integrity_constraint_violation';
END $$
"""
_PG_HEAD_GUARD: Final = """
CREATE OR REPLACE FUNCTION policy_head_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'UPDATE' OR NEW.id <> OLD.id OR NEW.version <> OLD.version + 1 THEN
    RAISE EXCEPTION 'kvguard policy: %% on policy_head may only step the version by one', TG_OP
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END $$
"""


def _pg(statement: str) -> DDL:
    return _ddl(statement, "postgresql")


def _pg_trigger(name: str, table: str, spec: str, function: str) -> list[DDL]:
    # ENABLE ALWAYS: the trigger fires even under session_replication_role = replica.
    return [
        _pg(f"CREATE TRIGGER {name} {spec} ON {table} {function}"),
        _pg(f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {name}"),
    ]


_ROW: Final = "FOR EACH ROW EXECUTE FUNCTION"
_STATEMENT: Final = "FOR EACH STATEMENT EXECUTE FUNCTION"

_VERSION_GUARDS: Final = [
    _sqlite_trigger("policy_versions_no_update", "UPDATE", "policy_versions"),
    _sqlite_trigger("policy_versions_no_delete", "DELETE", "policy_versions"),
    _pg(_PG_FORBID),
    *_pg_trigger(
        "policy_versions_append_only",
        "policy_versions",
        "BEFORE UPDATE OR DELETE",
        f"{_ROW} policy_forbid()",
    ),
    *_pg_trigger(
        "policy_versions_no_truncate",
        "policy_versions",
        "BEFORE TRUNCATE",
        f"{_STATEMENT} policy_forbid()",
    ),
]
_HEAD_GUARDS: Final = [
    _sqlite_trigger("policy_head_no_delete", "DELETE", "policy_head"),
    _sqlite_trigger(
        "policy_head_step_only",
        "UPDATE",
        "policy_head",
        "FOR EACH ROW WHEN NEW.id <> OLD.id OR NEW.version <> OLD.version + 1",
    ),
    _pg(_PG_FORBID),
    _pg(_PG_HEAD_GUARD),
    *_pg_trigger(
        "policy_head_step_only",
        "policy_head",
        "BEFORE UPDATE OR DELETE",
        f"{_ROW} policy_head_guard()",
    ),
    *_pg_trigger(
        "policy_head_no_truncate", "policy_head", "BEFORE TRUNCATE", f"{_STATEMENT} policy_forbid()"
    ),
]

for _guard in _VERSION_GUARDS:
    event.listen(PolicyVersionRow.__table__, "after_create", _guard)
for _guard in _HEAD_GUARDS:
    event.listen(PolicyHead.__table__, "after_create", _guard)
