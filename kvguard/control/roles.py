"""PostgreSQL grants for the app role on the control tables (the ledger's are in `kvguard.audit.roles`).

The owner role runs the migrations (`kvguard db migrate`, or the first `kvguard serve` as the owner);
the app role, used by the API, the engines and the front ends, gets exactly what they do: no DDL, no
DELETE outside the rows heartbeats rewrite, no UPDATE of history. `policy_versions` keeps its
append-only triggers and `policy_head` its step-by-one trigger whatever the grants. The id sequences
of `engine_commands` and `control_outbox` need USAGE, or every purge and policy write fails (the
0.1.0 docs omitted it).

`kvguard db grants APP_ROLE` prints these statements and the ledger's, in the order to run them.
"""

from __future__ import annotations

import re
from typing import Final

from kvguard.audit.roles import app_role_grants as ledger_grants
from kvguard.control.db import VERSION_TABLE
from kvguard.control.schema import metadata

_IDENTIFIER: Final = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_RESERVED: Final = frozenset({"public", "none", "current_user", "session_user", "current_role"})

# What each serving process does to each control table.
PRIVILEGES: Final = {
    "tenants": "SELECT, INSERT, UPDATE",  # create, disable, re-enable (a policy version)
    "admin_api_keys": "SELECT, INSERT, UPDATE",  # create, revoke, 0.1.0 hash upgrade
    "tenant_api_keys": "SELECT, INSERT, UPDATE",  # issue, revoke
    "policy_head": "SELECT, UPDATE",  # step by one (trigger-checked)
    "policy_versions": "SELECT, INSERT",  # append-only (trigger-checked)
    "engines": "SELECT, INSERT, UPDATE, DELETE",  # register (a restart replaces its row), heartbeats
    "engine_tenant_stats": "SELECT, INSERT, DELETE",  # rewritten whole with each heartbeat
    "scope_tags": "SELECT, INSERT",
    "command_head": "SELECT, UPDATE",  # commit-ordered command numbers
    "engine_commands": "SELECT, INSERT",
    "engine_command_acks": "SELECT, INSERT",
    "control_outbox": "SELECT, INSERT, UPDATE",  # drained: ledger_index set once
    "auth_failures": "SELECT, INSERT, UPDATE, DELETE",  # counted on failures, old windows dropped
}
SEQUENCES: Final = ("engine_commands_id_seq", "control_outbox_id_seq")


def check_role_name(app_role: str) -> None:
    """ValueError unless `app_role` can name one login role: a lower-case SQL identifier that is
    not a reserved role name. `GRANT ... TO public` grants to every role (DELETE on
    `ledger_payloads` included); `current_user`, `session_user` and `current_role` name whoever
    runs the statement (the owner); `none` and `pg_*` are reserved by PostgreSQL."""
    if not _IDENTIFIER.match(app_role):
        raise ValueError("role names are lower-case SQL identifiers")
    if app_role in _RESERVED or app_role.startswith("pg_"):
        raise ValueError(
            "that role name is reserved by PostgreSQL (public, none, current_user, "
            "session_user, current_role, pg_*): name the app role itself"
        )


def app_role_grants(app_role: str) -> list[str]:
    """SQL statements (run as the owner) granting `app_role` what the control plane needs."""
    check_role_name(app_role)
    missing = set(metadata.tables) - set(PRIVILEGES)
    if missing:  # a new table must be given its privileges here, on purpose
        raise RuntimeError(f"no app-role privileges defined for {sorted(missing)}")
    tables = sorted(PRIVILEGES)
    statements = [f"REVOKE ALL ON {', '.join([*tables, VERSION_TABLE])} FROM PUBLIC"]
    statements += [f"GRANT {PRIVILEGES[t]} ON {t} TO {app_role}" for t in tables]
    statements.append(f"GRANT SELECT ON {VERSION_TABLE} TO {app_role}")
    statements += [f"GRANT USAGE ON SEQUENCE {s} TO {app_role}" for s in SEQUENCES]
    return statements


def all_grants(app_role: str) -> list[str]:
    """The ledger's grants, then the control plane's: everything an app role needs."""
    check_role_name(app_role)
    return [*ledger_grants(app_role), *app_role_grants(app_role)]
