"""What the admin API process holds: its configuration and the stores it opens on the database.

Ownership: `Services` owns the ledger (and its background checkpoints), the policy store, the tenant and
key registries, the command queue, the outbox and the engine registry for the life of the app; routes
borrow them through `kvguard.api.deps`. Everything is opened from one database URL, the one engines
use too, on one control engine (`kvguard.control.db.open_engine`).

Writes: a route makes its change, its engine commands and its ledger events in one transaction
(`write()`), then `deliver()` drains the outbox into the ledger. A background drain every
`OUTBOX_DRAIN_S` seconds (and one at start-up) delivers what a crash or a ledger outage left pending.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import anyio.to_thread
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from kvguard.api.actions import ActionLog
from kvguard.api.auth import ApiKeys, FailureLimiter, SharedFailures
from kvguard.api.metrics import FleetCollector, new_registry
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.audit.witness_client import WitnessEndpoint
from kvguard.control.commands import CommandQueue
from kvguard.control.db import open_engine, write_transaction
from kvguard.control.engines import LIVE_MAX_AGE_S, EngineRegistry
from kvguard.control.key_cache import KeyCache
from kvguard.control.keys import TenantKeys
from kvguard.control.outbox import Deliverer, Outbox
from kvguard.control.publish import PolicyPublisher, PolicyWrite
from kvguard.control.tenants import TenantRegistry
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.salts import SaltDeriver
from kvguard.logging import get_logger
from kvguard.policy.store import PolicyChange, PolicyStore

DEFAULT_ORIGIN = "kvguard.local/ledger"
OUTBOX_DRAIN_S = 5.0
_log = get_logger("kvguard.api.services")
_in_write = threading.local()


def _plain(value: object) -> object:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _one_connection_per_write(*_args: object) -> None:
    if getattr(_in_write, "active", False):
        raise RuntimeError("a second database connection inside a write transaction")


CONFIG_ENV = "KVGUARD_API_CONFIG"  # how `kvguard serve --workers N` hands its config to workers


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """Settings of one API process (see `kvguard serve --help` and docs/operations.md)."""

    db_url: str
    signing_key_file: Path
    salt_keyring_file: Path
    origin: str = DEFAULT_ORIGIN
    # An engine whose last heartbeat is older than this is not waited for by purge jobs.
    engine_max_age_s: float = LIVE_MAX_AGE_S
    auth_max_failures: int = 10
    auth_window_s: float = 60.0
    # Request bodies over this are refused (413) before they are read; policy PUTs, the largest
    # legitimate bodies, stay far below.
    max_body_bytes: int = 1 << 20
    checkpoint_interval_s: float | None = 60.0
    # Seconds between background drains of the ledger outbox (None: only after writes and at start).
    outbox_drain_s: float | None = OUTBOX_DRAIN_S
    # Requests handled at once per process (anyio worker threads; see create_app's lifespan).
    worker_threads: int = 8
    # c2sp.org/tlog-witness endpoints ("URL=VKEY") that cosign every checkpoint.
    witnesses: tuple[str, ...] = ()
    # More checkpoint signing keys during a rotation: checkpoints carry every key's signature.
    more_signing_key_files: tuple[Path, ...] = ()

    def to_json(self) -> str:
        """The settings as JSON (paths and URL only: no secret is in them)."""
        return json.dumps({f: _plain(getattr(self, f)) for f in self.__dataclass_fields__})

    @classmethod
    def from_json(cls, text: str) -> ApiConfig:
        data = json.loads(text)
        for name in ("signing_key_file", "salt_keyring_file"):
            data[name] = Path(data[name])
        data["witnesses"] = tuple(data.get("witnesses", ()))
        data["more_signing_key_files"] = tuple(
            Path(p) for p in data.get("more_signing_key_files", ())
        )
        return cls(**data)


class PolicyWriter:
    """Runs this process's policy writes on one thread, in group commits, awaited from the event
    loop.

    One thread: a policy write is a compare-and-set on the policy head (`kvguard.control.publish`),
    so two writers of one process would only make each other redo their edit; and a write waiting
    for its turn holds none of the request threads (with the head's row lock as the queue, most
    request threads ended up waiting on it, docs/benchmarks.md). Group commit: the writes that
    arrive while a group is being stored go together in the next one (`publish_group`): one
    transaction and one pipelined round trip for up to `max_group` versions, each an edit of the
    one before it, instead of one write at a time on a thread that waits for the GIL at every
    round trip (docs/benchmarks.md, "Group commit of policy writes", 2026-11-27)."""

    def __init__(
        self, publisher: PolicyPublisher, *, max_group: int = 32, name: str = "kvguard-policy"
    ) -> None:
        self._publisher = publisher
        self._max_group = max_group
        self._lock = threading.Lock()  # guards `_queued` and `_draining`
        self._queued: list[tuple[PolicyWrite, Future[PolicyChange]]] = []
        self._draining = False  # a drain is submitted to the thread and has not returned
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def publish(self, write: PolicyWrite) -> PolicyChange:
        """`write` stored (its change), or its refusal raised, once its group has committed."""
        context = contextvars.copy_context()  # the request's log context, as anyio's threads get
        edit, events = write.edit, write.events
        write = replace(
            write,
            edit=lambda base: context.run(edit, base),
            events=lambda change: context.run(events, change),
        )
        future: Future[PolicyChange] = Future()
        with self._lock:
            self._queued.append((write, future))
            if not self._draining:
                self._draining = True
                self._pool.submit(self._drain)
        return await asyncio.wrap_future(future)

    def _drain(self) -> None:
        while True:
            with self._lock:
                group = self._queued[: self._max_group]
                del self._queued[: self._max_group]
                if not group:
                    self._draining = False
                    return
            try:
                outcomes = self._publisher.publish_group([write for write, _ in group])
            except Exception as exc:  # nothing of the group is stored: each waiter gets the error
                outcomes = [exc] * len(group)
            for (_, future), outcome in zip(group, outcomes, strict=True):
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


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
    outbox: Outbox
    publisher: PolicyPublisher
    policy_writer: PolicyWriter
    clock: Callable[[], float] = field(default=time.time)
    key_cache: KeyCache | None = None  # PostgreSQL only (kvguard.control.key_cache)
    _deliverer: Deliverer | None = None

    @classmethod
    def open(cls, config: ApiConfig, *, clock: Callable[[], float] = time.time) -> Services:
        db = open_engine(config.db_url)
        sa.event.listen(db, "checkout", _one_connection_per_write)
        ledger = Ledger.open(
            config.db_url,
            origin=config.origin,
            signing_key=[
                SigningKey.load(path)
                for path in (config.signing_key_file, *config.more_signing_key_files)
            ],
            clock=lambda: datetime.fromtimestamp(clock(), UTC),
            checkpoint_interval=config.checkpoint_interval_s,
            witnesses=[WitnessEndpoint.parse(w) for w in config.witnesses],
        )
        deriver = SaltDeriver(Keyring.load(config.salt_keyring_file))
        registry, append_seconds = new_registry()
        outbox = Outbox(db)
        policies = PolicyStore(db, clock=clock)
        commands = CommandQueue(db)
        # The key rows of authenticated keys, kept coherent with revocations by a listener on a
        # connection of its own: no key-row read per request (docs/benchmarks.md).
        publisher = PolicyPublisher(policies, outbox, commands, clock=clock)
        key_cache = KeyCache(db).start() if db.dialect.name == "postgresql" else None
        services = cls(
            config=config,
            db=db,
            ledger=ledger,
            policies=policies,
            tenants=TenantRegistry(db, clock=clock),
            keys=ApiKeys(db, clock=clock, cache=key_cache),
            inference_keys=TenantKeys(db),
            commands=commands,
            engines=EngineRegistry(db),
            deriver=deriver,
            limiter=FailureLimiter(
                max_failures=config.auth_max_failures,
                window_s=config.auth_window_s,
                shared=SharedFailures(
                    db, max_failures=config.auth_max_failures, window_s=config.auth_window_s
                ),
            ),
            actions=ActionLog(ledger, deriver, clock, outbox=outbox, append_seconds=append_seconds),
            metrics=registry,
            outbox=outbox,
            publisher=publisher,
            policy_writer=PolicyWriter(publisher),
            clock=clock,
            key_cache=key_cache,
        )
        registry.register(FleetCollector(services))  # reads the fleet at scrape time
        services.deliver()  # what a crash left pending
        services._deliverer = Deliverer(services.actions.deliver, interval_s=config.outbox_drain_s)
        services.actions.deliver_hook = services.deliver
        return services

    @contextmanager
    def write(self) -> Iterator[sa.Connection]:
        """One write transaction on the control database: state, commands and outbox events
        commit together or not at all. Everything inside uses `conn`: a second pooled connection
        taken while the transaction holds its row locks could wait on them forever under load
        (every pooled connection waiting for the lock this one holds), so it is refused."""
        with write_transaction(self.db) as conn:
            _in_write.active = True
            try:
                yield conn
            finally:
                _in_write.active = False

    def deliver(self) -> bool:
        """Drain the outbox into the ledger (group commits on the delivery thread, once it runs);
        False (logged) when the ledger cannot be written now: the events stay committed in the
        outbox for the next drain."""
        if self._deliverer is not None:
            return self._deliverer.deliver()
        return self.actions.try_deliver()

    async def deliver_async(self) -> bool:
        """`deliver`, awaited on the event loop (no request thread waits for the drain)."""
        if self._deliverer is not None:
            return await self._deliverer.deliver_async()
        return await anyio.to_thread.run_sync(self.actions.try_deliver)

    def tenant_ledger_tags(self, tenant_id: str) -> list[str]:
        """The scope tags of a tenant's ledger entries: the `st_` tags engines registered for its
        scopes and the `tt_` tag the API's own `admin.action` entries about it carry."""
        return sorted(
            {*self.engines.tags_for_tenant(tenant_id), self.deriver.tenant_tag(tenant_id)}
        )

    def close(self) -> None:
        if self.key_cache is not None:
            self.key_cache.close()
        self.policy_writer.close()
        if self._deliverer is not None:
            self._deliverer.close()
            self._deliverer = None
        self.deliver()
        self.ledger.close()
        self.db.dispose()
