"""The PostgreSQL statements of `kvguard.control.publish`: one round trip per admin write.

Data-modifying WITH: every part runs once, on one snapshot, and commits together. Each insert
selects from the step before it, so a head that has moved (`head` empty) writes nothing (the
table names are those of `kvguard.control.schema`). The outbox rows are inserted in the order
given (ids ascending), as `Outbox.add` does. PostgreSQL runs every data-modifying part whether or
not the final SELECT reads it. `pg_notify` is sent at commit, as NOTIFY is.
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa

PG_POLICY_WRITE: Final = sa.text(
    """
WITH head AS (
    UPDATE policy_head SET version = :version
    WHERE id = :head_id AND version = :base
    RETURNING version
), stored AS (
    INSERT INTO policy_versions
        (version, created_at, author, reason, digest, document, author_role, limits_of)
    SELECT version, :created_at, :author, :reason, :digest, :document, :author_role, :limits_of
    FROM head
    RETURNING version
), events AS (
    INSERT INTO control_outbox (created_at, event)
    SELECT :now, e.event
    FROM stored CROSS JOIN unnest(CAST(:events AS text[])) WITH ORDINALITY AS e(event, n)
    ORDER BY e.n
), reenabled AS (
    UPDATE tenants SET disabled_at = NULL, disabled_by = NULL, disable_reason = NULL
    WHERE tenant_id = ANY(CAST(:reenabled AS text[])) AND disabled_at IS NOT NULL
        AND EXISTS (SELECT 1 FROM stored)
), seq AS (
    UPDATE command_head SET seq = seq + 1
    WHERE id = :head_id AND EXISTS (SELECT 1 FROM stored)
    RETURNING seq
), command AS (
    INSERT INTO engine_commands
        (created_at, seq, kind, selector_kind, selector_value, tenant_id, requested_by)
    SELECT :now, seq, 'policy', 'version', :selector_value, NULL, :requested_by FROM seq
    RETURNING id
)
SELECT command.id FROM command CROSS JOIN LATERAL (SELECT pg_notify(:channel, '')) AS notified
"""
)

PG_NEXT_COMMAND_ID: Final = sa.text(
    "SELECT nextval(pg_get_serial_sequence('engine_commands', 'id'))"
)

PG_PURGE_WRITE: Final = sa.text(
    """
WITH seq AS (
    UPDATE command_head SET seq = seq + 1 WHERE id = :head_id RETURNING seq
), command AS (
    INSERT INTO engine_commands
        (id, created_at, seq, kind, selector_kind, selector_value, tenant_id, requested_by)
    SELECT :id, :now, seq, 'purge', :selector_kind, :selector_value, :tenant_id, :requested_by
    FROM seq
    RETURNING id
), events AS (
    INSERT INTO control_outbox (created_at, event)
    SELECT :now, e.event
    FROM command CROSS JOIN unnest(CAST(:events AS text[])) WITH ORDINALITY AS e(event, n)
    ORDER BY e.n
)
SELECT command.id FROM command CROSS JOIN LATERAL (SELECT pg_notify(:channel, '')) AS notified
"""
)
