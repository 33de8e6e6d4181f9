"""PostgreSQL role setup for the ledger: an owner role that migrates, an app role that appends.

The owner role owns the tables and triggers (run `Ledger.open` as it once, to migrate). The app
role, which serving processes use, gets only what appending needs: SELECT and INSERT on the ledger
tables, UPDATE of the head row's `id` column only (`SELECT ... FOR UPDATE` needs some UPDATE
privilege to lock the row; the guard refuses any change of the id), and DELETE on payloads
(erasure). The head's size and checkpoint size move only through the owner's `SECURITY DEFINER`
triggers when entries and checkpoints are inserted (migration 0004). The app role can neither
UPDATE, DELETE nor TRUNCATE history, nor drop or disable the triggers (only a table's owner or a
superuser can). See docs/audit.md for what this does not stop.
"""

from __future__ import annotations

import re

from kvguard.audit.schema import metadata

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_VERSION_TABLE = "ledger_alembic_version"


def app_role_grants(app_role: str) -> list[str]:
    """SQL statements (run as the owner) granting `app_role` the append-only privileges."""
    if not _IDENTIFIER.match(app_role):
        raise ValueError("role names are lower-case SQL identifiers")
    tables = sorted(metadata.tables)
    statements = [f"REVOKE ALL ON {', '.join([*tables, _VERSION_TABLE])} FROM PUBLIC"]
    statements += [f"GRANT SELECT, INSERT ON {t} TO {app_role}" for t in tables]
    statements += [
        f"GRANT SELECT ON {_VERSION_TABLE} TO {app_role}",
        f"GRANT UPDATE (id) ON ledger_head TO {app_role}",
        f"GRANT DELETE ON ledger_payloads TO {app_role}",
    ]
    return statements
