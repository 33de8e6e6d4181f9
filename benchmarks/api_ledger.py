"""A large, realistic ledger for `benchmarks/api_bench.py`, built the way `audit_bench.py` builds
its: durable `Ledger.append_many` batches of 10,000 events on SQLite (WAL, synchronous=FULL).

Shape (deterministic, seeded): 16 tenants with 4 engine scope tags each (registered through
`EngineRegistry.heartbeat(new_tags=...)`, as engines do), tenant 15 sparse (one event in 5,000).
Kinds: `block.*` custody events (alloc 30%, release 25%, reuse 20%, zeroize 20%, evict 5%), one
`admin.action` per 1,000 entries carrying a tenant's `tt_` tag and an erasable payload, one
`policy.change` per 100,000. Six entries per request id, two block ids of 65,536 per entry, one
entry per millisecond with up to 5 ms of jitter (engines submit in roughly, not exactly, time
order).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from kvguard.api.auth import ApiKeys, Role
from kvguard.audit.db import create_engine
from kvguard.audit.events import AuditEvent
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.control.engines import EngineRegistry
from kvguard.control.tenants import TenantRegistry
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.salts import SaltDeriver

T0 = datetime(2026, 11, 26, tzinfo=UTC)
ORIGIN = "bench.kvguard/api"
TENANTS = [f"t{i:02d}" for i in range(16)]
SPARSE = TENANTS[-1]
BATCH = 10_000
_KINDS = (
    ["block.alloc"] * 30
    + ["block.release"] * 25
    + ["block.reuse"] * 20
    + ["block.zeroize"] * 20
    + ["block.evict"] * 5
)


@dataclass(frozen=True)
class BenchLedger:
    directory: Path
    url: str
    size: int
    keys: dict[str, str]  # "admin", "auditor", and one tenant_admin key per tenant id

    @property
    def signing_key_file(self) -> Path:
        return self.directory / "signing.key"

    @property
    def keyring_file(self) -> Path:
        return self.directory / "salt.keys"

    def verifier_key(self) -> str:
        return SigningKey.load(self.signing_key_file).verifier_key()


def scope_tags(tenant: str) -> list[str]:
    return [f"st_{tenant}_{j}" for j in range(4)]


def _event(i: int, rng: random.Random, tenant_tags: Mapping[str, str]) -> AuditEvent:
    ts = T0 + timedelta(microseconds=i * 1_000 + rng.randrange(5_000))
    if i % 100_000 == 99_999:
        return AuditEvent(kind="policy.change", ts=ts, details={"policy_version": i // 100_000})
    tenant = SPARSE if i % 5_000 == 17 else TENANTS[i % 15]
    if i % 1_000 == 500:
        return AuditEvent(
            kind="admin.action",
            scope_tag=tenant_tags[tenant],
            ts=ts,
            details={"principal": "key:bench", "role": "admin", "action": "tenant.policy.put"},
            payload={"tenant_id": tenant},
        )
    return AuditEvent(
        kind=_KINDS[i % 100],
        scope_tag=scope_tags(tenant)[(i // 15) % 4],
        request_id=f"req-{i // 6}",
        block_ids=[rng.randrange(65_536), rng.randrange(65_536)],
        details={"blocks": 2, "layer_bytes": 65_536},
        ts=ts,
    )


def build(directory: Path, entries: int) -> BenchLedger:
    """Create (or reuse: a finished build holds at least `entries` entries, the benchmark's own
    admin actions included) the benchmark database."""
    directory.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{directory / 'ledger.db'}"
    if not (directory / "signing.key").exists():
        SigningKey.generate("bench.kvguard").save(directory / "signing.key")
        Keyring.generate("k1").save(directory / "salt.keys")
    deriver = SaltDeriver(Keyring.load(directory / "salt.keys"))
    tenant_tags = {t: deriver.tenant_tag(t) for t in TENANTS}
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=SigningKey.load(directory / "signing.key"))
    try:
        size = ledger.size
        rng = random.Random(6)
        start = time.perf_counter()
        for first in range(ledger.size, entries, BATCH):
            stop = min(entries, first + BATCH)
            ledger.append_many([_event(i, rng, tenant_tags) for i in range(first, stop)])
        if ledger.size and time.perf_counter() - start > 1:
            print(f"built {entries:,} entries in {time.perf_counter() - start:.0f} s")
        ledger.checkpoint()
    finally:
        ledger.close()
    return BenchLedger(directory, url, max(entries, size), _register(url))


def _register(url: str) -> dict[str, str]:
    """Tenants, their scope tags (as engines report them) and one API key per role and tenant."""
    db = create_engine(url)
    try:
        engines = EngineRegistry(db)
        engines.register("bench-engine", model="m", block_size=16, num_blocks=65_536, now=0.0)
        pairs = [(tag, t) for t in TENANTS for tag in scope_tags(t)]
        engines.heartbeat("bench-engine", now=1.0, totals={}, tenants=(), new_tags=pairs)
        registry = TenantRegistry(db, clock=time.time)
        known = {t.tenant_id for t in registry.list(only=None, after=None, limit=100)}
        for tenant in TENANTS:
            if tenant not in known:
                registry.create(tenant, display_name=tenant, created_by="bench")
        api_keys = ApiKeys(db, clock=time.time)
        keys = {
            "admin": api_keys.create(Role.ADMIN).api_key,
            "auditor": api_keys.create(Role.AUDITOR).api_key,
        }
        for tenant in TENANTS:
            keys[tenant] = api_keys.create(Role.TENANT_ADMIN, tenant_id=tenant).api_key
        return keys
    finally:
        db.dispose()
