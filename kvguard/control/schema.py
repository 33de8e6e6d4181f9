"""Every non-ledger table of kvguard, on one MetaData: the contract between the admin API and the engines.

`kvguard.control` owns it. The admin API, the CLI and the engines read and write these tables only
through the stores of this package; the schema changes only through the Alembic history in
`kvguard/control/migrations` (version table `control_alembic_version`, beside the ledger's own
`ledger_alembic_version`), which `kvguard.control.db.upgrade` runs.

Tables:
- `tenants`: the registry the admin API scopes everything to.
- `admin_api_keys`, `tenant_api_keys`: the two key kinds (admin API keys, inference keys). Secrets are
  stored as keyed hashes only (`kvguard.control.keys`).
- `policy_head`, `policy_versions`: versioned policy; versions are append-only (database triggers) and
  numbered gaplessly from the head row.
- `engines`, `engine_tenant_stats`, `scope_tags`: the engine registry (`kvguard.control.engines`).
- `command_head`, `engine_commands`, `engine_command_acks`: commands for engines, numbered in commit
  order (`seq`, taken under the head row's lock) and acknowledged per engine (`kvguard.control.commands`).
- `control_outbox`: ledger events written in the same transaction as the state they describe, drained
  into the ledger exactly once (`kvguard.control.outbox`).
"""

from __future__ import annotations

from typing import Final

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

HEAD_ID: Final = 1
AUTHOR_MAX: Final = 256
REASON_MAX: Final = 2000
TENANT_ID_MAX: Final = 128
SELECTOR_VALUE_MAX: Final = 256  # a purge's session, tenant, model or adapter id
# `policy_versions.limits_of` (tenant ids start with a letter or digit, so neither is one).
ALL_TENANTS: Final = "*"  # an admin's version that sets every tenant's limits
NO_LIMITS: Final = "-"  # a tenant_admin's version: it sets no limits


class ControlBase(DeclarativeBase):
    metadata = sa.MetaData()


metadata: Final = ControlBase.metadata


# --- tenants and keys ---------------------------------------------------------------------------


class TenantRow(ControlBase):
    __tablename__ = "tenants"

    tenant_id: Mapped[str] = mapped_column(sa.String(TENANT_ID_MAX), primary_key=True)
    display_name: Mapped[str] = mapped_column(sa.String(256))
    created_at: Mapped[float] = mapped_column(sa.Float)
    created_by: Mapped[str] = mapped_column(sa.String(128))
    disabled_at: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    disabled_by: Mapped[str | None] = mapped_column(sa.String(128), nullable=True)
    disable_reason: Mapped[str | None] = mapped_column(sa.String(500), nullable=True)


class AdminKeyRow(ControlBase):
    """An admin API key. `secret_hash` is HMAC-SHA256(salt, secret); `secret_scrypt` is only set on
    keys issued by 0.1.0 (checked once with scrypt, then given a `secret_hash`)."""

    __tablename__ = "admin_api_keys"

    key_id: Mapped[str] = mapped_column(sa.String(12), primary_key=True)
    salt: Mapped[bytes] = mapped_column(sa.LargeBinary(16))
    secret_scrypt: Mapped[bytes | None] = mapped_column(sa.LargeBinary(32), nullable=True)
    secret_hash: Mapped[bytes | None] = mapped_column(sa.LargeBinary(32), nullable=True)
    role: Mapped[str] = mapped_column(sa.String(16))
    tenant_id: Mapped[str | None] = mapped_column(sa.String(TENANT_ID_MAX), nullable=True)
    label: Mapped[str] = mapped_column(sa.String(200), default="")
    created_at: Mapped[float] = mapped_column(sa.Float)
    revoked_at: Mapped[float | None] = mapped_column(sa.Float, nullable=True)


class TenantKeyRow(ControlBase):
    """An inference key of one tenant: SHA-256 of its 256-bit random secret."""

    __tablename__ = "tenant_api_keys"

    key_id: Mapped[str] = mapped_column(sa.String(12), primary_key=True)
    secret_sha256: Mapped[bytes] = mapped_column(sa.LargeBinary(32))
    tenant_id: Mapped[str] = mapped_column(sa.String(256), index=True)
    created_at: Mapped[float] = mapped_column(sa.Float)
    revoked: Mapped[bool] = mapped_column(sa.Boolean, default=False)

    # A tenant's keys newest first, paged (`TenantKeys.list`).
    __table_args__ = (sa.Index("ix_tenant_api_keys_listing", "tenant_id", "created_at", "key_id"),)


# --- policy ---------------------------------------------------------------------------------------


class PolicyHead(ControlBase):
    """The single row whose lock serializes writers and whose value is the latest version."""

    __tablename__ = "policy_head"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(sa.BigInteger)


class PolicyVersionRow(ControlBase):
    """One stored version: who (and in which role), when, why, and the canonical JSON with its digest.

    `author_role` is `admin` for versions that set the limits a tenant_admin may only tighten (every
    version not written by a tenant_admin; NULL on versions stored before 0.2, read as `admin`).
    `limits_of` says whose limits a version sets: `*` (`ALL_TENANTS`) every tenant's (an admin's
    whole-set write, a seed), a tenant id that tenant's only (an admin's edit of one tenant's entry,
    a disable), `-` (`NO_LIMITS`) none (a tenant_admin's version); NULL on versions stored before
    the column existed (read by `author_role`: an admin's sets every tenant's)."""

    __tablename__ = "policy_versions"
    __table_args__ = (sa.Index("ix_policy_versions_limits_of", "limits_of", "version"),)
    version: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    created_at: Mapped[float] = mapped_column(sa.Double)  # seconds on the store's clock (UNIX time)
    author: Mapped[str] = mapped_column(sa.String(AUTHOR_MAX))
    reason: Mapped[str] = mapped_column(sa.String(REASON_MAX))
    digest: Mapped[str] = mapped_column(sa.String(71))
    document: Mapped[str] = mapped_column(sa.Text)
    author_role: Mapped[str | None] = mapped_column(sa.String(16), nullable=True)
    limits_of: Mapped[str | None] = mapped_column(sa.String(256), nullable=True)


# --- engines --------------------------------------------------------------------------------------


class EngineRow(ControlBase):
    __tablename__ = "engines"

    engine_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    model: Mapped[str] = mapped_column(sa.String(512))
    block_size: Mapped[int] = mapped_column(sa.Integer)
    num_blocks: Mapped[int] = mapped_column(sa.BigInteger)
    started_at: Mapped[float] = mapped_column(sa.Double)
    last_seen: Mapped[float] = mapped_column(sa.Double)
    stats_at: Mapped[float | None] = mapped_column(sa.Double, nullable=True)
    stopped_at: Mapped[float | None] = mapped_column(sa.Double, nullable=True)
    totals: Mapped[str] = mapped_column(sa.Text, default="{}")  # JSON: counts and sums only
    # The last command sequence number the engine had seen when it registered: it runs every
    # command after it, so purge jobs know which engines to wait for.
    command_seq_start: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)


class EngineTenantStatsRow(ControlBase):
    __tablename__ = "engine_tenant_stats"

    engine_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(256), primary_key=True, index=True)
    tenant_tag: Mapped[str] = mapped_column(sa.String(64))
    blocks_active: Mapped[int] = mapped_column(sa.BigInteger)
    blocks_cached: Mapped[int] = mapped_column(sa.BigInteger)
    blocks_quarantined: Mapped[int] = mapped_column(sa.BigInteger)
    prefix_hit_tokens: Mapped[int] = mapped_column(sa.BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger)
    blocks_zeroized: Mapped[int] = mapped_column(sa.BigInteger)
    bytes_zeroized: Mapped[int] = mapped_column(sa.BigInteger)
    # The offload tier (docs/offload.md): migration 0003.
    tier_spilled_blocks: Mapped[int] = mapped_column(sa.BigInteger, server_default="0")
    tier_spilled_bytes: Mapped[int] = mapped_column(sa.BigInteger, server_default="0")
    tier_restored_blocks: Mapped[int] = mapped_column(sa.BigInteger, server_default="0")
    tier_hit_tokens: Mapped[int] = mapped_column(sa.BigInteger, server_default="0")
    oldest_cached_at: Mapped[float | None] = mapped_column(sa.Double, nullable=True)
    updated_at: Mapped[float] = mapped_column(sa.Double)


class ScopeTagRow(ControlBase):
    __tablename__ = "scope_tags"

    scope_tag: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(256), index=True)
    first_seen: Mapped[float] = mapped_column(sa.Double)


# --- commands -------------------------------------------------------------------------------------


class CommandHead(ControlBase):
    """The single row whose lock orders commands: `seq` is the last number handed out."""

    __tablename__ = "command_head"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(sa.BigInteger)


class EngineCommand(ControlBase):
    __tablename__ = "engine_commands"
    __table_args__ = (
        sa.Index("engine_commands_seq_key", "seq", unique=True),
        # A tenant's purge listing (`kvguard.api.purge_jobs.list_jobs`): O(page), not O(all jobs).
        sa.Index("ix_engine_commands_tenant", "tenant_id", "kind", "id"),
        sa.Index("ix_engine_commands_selector", "selector_value", "selector_kind", "kind", "id"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(sa.String(32))
    selector_kind: Mapped[str] = mapped_column(sa.String(16))
    selector_value: Mapped[str] = mapped_column(sa.String(SELECTOR_VALUE_MAX))
    tenant_id: Mapped[str | None] = mapped_column(sa.String(256), nullable=True)
    requested_by: Mapped[str] = mapped_column(sa.String(256))
    created_at: Mapped[float] = mapped_column(sa.Float)
    # Commit order (gapless, taken under command_head's row lock). NULL only on 0.1.0 rows, which
    # the migration numbers by id.
    seq: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)


class EngineCommandAck(ControlBase):
    __tablename__ = "engine_command_acks"

    command_id: Mapped[int] = mapped_column(sa.ForeignKey("engine_commands.id"), primary_key=True)
    engine_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    done_at: Mapped[float] = mapped_column(sa.Float)
    result: Mapped[str] = mapped_column(sa.Text)  # JSON: counts only, never identifiers of blocks


# --- failed authentications -------------------------------------------------------------------


class AuthFailureRow(ControlBase):
    """Failed authentications of one subject (`addr:<client address>` or `key:<key id>`) in the
    window that began at `window_start` (UNIX time), shared by every API process
    (`kvguard.api.auth.SharedFailures`); only ever written on a failure."""

    __tablename__ = "auth_failures"

    subject: Mapped[str] = mapped_column(sa.String(320), primary_key=True)
    window_start: Mapped[float] = mapped_column(sa.Double)
    failures: Mapped[int] = mapped_column(sa.Integer)


# --- outbox ---------------------------------------------------------------------------------------


class OutboxRow(ControlBase):
    """A ledger event committed with its state change; `ledger_index` is set, exactly once, in the
    ledger transaction that appends it."""

    __tablename__ = "control_outbox"

    id: Mapped[int] = mapped_column(
        sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    created_at: Mapped[float] = mapped_column(sa.Double)
    event: Mapped[str] = mapped_column(sa.Text)  # JSON of the AuditEvent (kvguard.control.outbox)
    ledger_index: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    __table_args__ = (sa.Index("ix_control_outbox_ledger_index", "ledger_index"),)


# --- database-level guards of the policy history --------------------------------------------------


def _sqlite_trigger(name: str, when: str, table: str, guard: str = "") -> str:
    return (
        f"CREATE TRIGGER {name} BEFORE {when} ON {table} {guard} BEGIN "
        f"SELECT RAISE(ABORT, 'kvguard policy: {when} on {table} is forbidden'); END"
    )


_PG_FORBID: Final = """
CREATE OR REPLACE FUNCTION policy_forbid() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'kvguard policy: % on % is forbidden', TG_OP, TG_TABLE_NAME
    USING ERRCODE = 'integrity_constraint_violation';
END $$
"""
_PG_HEAD_GUARD: Final = """
CREATE OR REPLACE FUNCTION policy_head_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'UPDATE' OR NEW.id <> OLD.id OR NEW.version <> OLD.version + 1 THEN
    RAISE EXCEPTION 'kvguard policy: % on policy_head may only step the version by one', TG_OP
      USING ERRCODE = 'integrity_constraint_violation';
  END IF;
  RETURN NEW;
END $$
"""

_ROW: Final = "FOR EACH ROW EXECUTE FUNCTION"
_STATEMENT: Final = "FOR EACH STATEMENT EXECUTE FUNCTION"


def _pg_trigger(name: str, table: str, spec: str, function: str) -> list[str]:
    # ENABLE ALWAYS: the trigger fires even under session_replication_role = replica.
    return [
        f"CREATE TRIGGER {name} {spec} ON {table} {function}",
        f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER {name}",
    ]


# (dialect, statement) pairs, run by the migrations with exec_driver_sql (no %-formatting).
POLICY_VERSION_GUARDS: Final[list[tuple[str, str]]] = [
    ("sqlite", _sqlite_trigger("policy_versions_no_update", "UPDATE", "policy_versions")),
    ("sqlite", _sqlite_trigger("policy_versions_no_delete", "DELETE", "policy_versions")),
    ("postgresql", _PG_FORBID),
    *(
        ("postgresql", s)
        for s in _pg_trigger(
            "policy_versions_append_only",
            "policy_versions",
            "BEFORE UPDATE OR DELETE",
            f"{_ROW} policy_forbid()",
        )
    ),
    *(
        ("postgresql", s)
        for s in _pg_trigger(
            "policy_versions_no_truncate",
            "policy_versions",
            "BEFORE TRUNCATE",
            f"{_STATEMENT} policy_forbid()",
        )
    ),
]
POLICY_HEAD_GUARDS: Final[list[tuple[str, str]]] = [
    ("sqlite", _sqlite_trigger("policy_head_no_delete", "DELETE", "policy_head")),
    (
        "sqlite",
        _sqlite_trigger(
            "policy_head_step_only",
            "UPDATE",
            "policy_head",
            "FOR EACH ROW WHEN NEW.id <> OLD.id OR NEW.version <> OLD.version + 1",
        ),
    ),
    ("postgresql", _PG_FORBID),
    ("postgresql", _PG_HEAD_GUARD),
    *(
        ("postgresql", s)
        for s in _pg_trigger(
            "policy_head_step_only",
            "policy_head",
            "BEFORE UPDATE OR DELETE",
            f"{_ROW} policy_head_guard()",
        )
    ),
    *(
        ("postgresql", s)
        for s in _pg_trigger(
            "policy_head_no_truncate",
            "policy_head",
            "BEFORE TRUNCATE",
            f"{_STATEMENT} policy_forbid()",
        )
    ),
]
