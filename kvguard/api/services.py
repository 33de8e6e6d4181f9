"""What the admin API process holds: its configuration and the stores it opens on the database.

Ownership: `Services` owns the ledger (and its background checkpoints), the policy store, the tenant and
key registries, the command queue and the engine registry for the life of the app; routes borrow them
through `kvguard.api.deps`. Everything is opened from one database URL, the one engines use too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from kvguard.api.actions import ActionLog
from kvguard.api.auth import ApiKeys, FailureLimiter
from kvguard.api.metrics import FleetCollector, new_registry
from kvguard.audit.db import create_engine
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.control.engines import EngineRegistry
from kvguard.control.tenants import TenantRegistry
from kvguard.engine_adapter.commands import CommandQueue
from kvguard.engine_adapter.tenant_keys import TenantKeys
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.salts import SaltDeriver
from kvguard.policy.store import PolicyStore

DEFAULT_ORIGIN = "kvguard.local/ledger"


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """Settings of one API process (see `kvguard serve --help` and docs/operations.md)."""

    db_url: str
    signing_key_file: Path
    salt_keyring_file: Path
    origin: str = DEFAULT_ORIGIN
    # An engine whose last heartbeat is older than this is not waited for by purge jobs.
    engine_max_age_s: float = 10.0
    auth_max_failures: int = 10
    auth_window_s: float = 60.0
    checkpoint_interval_s: float | None = 60.0


@dataclass
class Services:
    config: ApiConfig
    db: sa.Engine
    ledger: Ledger
    policies: PolicyStore
    tenants: TenantRegistry
    keys: ApiKeys
    inference_keys: TenantKeys
    commands: CommandQueue
    engines: EngineRegistry
    deriver: SaltDeriver
    limiter: FailureLimiter
    actions: ActionLog
    metrics: CollectorRegistry
    clock: Callable[[], float] = field(default=time.time)

    @classmethod
    def open(cls, config: ApiConfig, *, clock: Callable[[], float] = time.time) -> Services:
        db = create_engine(config.db_url)
        ledger = Ledger.open(
            config.db_url,
            origin=config.origin,
            signing_key=SigningKey.load(config.signing_key_file),
            clock=lambda: datetime.fromtimestamp(clock(), UTC),
            checkpoint_interval=config.checkpoint_interval_s,
        )
        deriver = SaltDeriver(Keyring.load(config.salt_keyring_file))
        registry, append_seconds = new_registry()
        services = cls(
            config=config,
            db=db,
            ledger=ledger,
            policies=PolicyStore.open(config.db_url, clock=clock),
            tenants=TenantRegistry(db, clock=clock),
            keys=ApiKeys(db, clock=clock),
            inference_keys=TenantKeys(db),
            commands=CommandQueue(db),
            engines=EngineRegistry(db),
            deriver=deriver,
            limiter=FailureLimiter(
                max_failures=config.auth_max_failures, window_s=config.auth_window_s
            ),
            actions=ActionLog(ledger, deriver, clock, append_seconds=append_seconds),
            metrics=registry,
            clock=clock,
        )
        registry.register(FleetCollector(services))  # reads the fleet at scrape time
        return services

    def tenant_ledger_tags(self, tenant_id: str) -> list[str]:
        """The scope tags of a tenant's ledger entries: the `st_` tags engines registered for its
        scopes and the `tt_` tag the API's own `admin.action` entries about it carry."""
        return sorted(
            {*self.engines.tags_for_tenant(tenant_id), self.deriver.tenant_tag(tenant_id)}
        )

    def close(self) -> None:
        self.ledger.close()
        self.policies.engine.dispose()
        self.db.dispose()
