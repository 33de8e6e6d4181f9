"""Purge jobs as the admin API reports them: the command row, the engines expected to run it, their
acknowledgements, and how far the evidence in the ledger has come.

A job is an `engine_commands` row of kind `purge` (`kvguard.control.commands`); its id is the
job id. Status, worked out on every read:

- `queued`: no engine has acknowledged it yet;
- `running`: some engine acknowledged it, but not every expected engine has, or the ledger does not
  yet hold an acknowledging engine's purge entry, a clear of every block it quarantined and, for an
  engine with an offload tier, a `key.shred` entry of every data key the purge had to destroy there
  (`kvguard.audit.erasure`); each engine's `missing` says what the ledger still lacks;
- `done`: every expected engine (and any other that ran the job) acknowledged it, its evidence is
  complete in the ledger, and so is the request's own entry (`purge.create` / `tenant.disable`,
  committed with the job and drained from the outbox): no certificate is issued without it. A job created while no engine was live is done at once with nothing to
  clear (`no_live_engines`);
- `incomplete`: nothing is left running, but an expected engine stopped, or stopped heartbeating,
  before finishing. Its cache went with its process; no certificate is issued for such a job.

Expected engines are those live when the job was created (at time T): registered at or before T, not
stopped before T, last heartbeat at or after T - `engine_max_age_s`. This is derived from the engine
registry rather than stored: heartbeats only move forward and a restarted engine registers under a
new id with an empty cache (and executes no command older than itself), so the set read later is
the set that was live at T. An engine whose heartbeats had lapsed at T and then resumed is waited
for too; it executes every command created after it started.

Tenant scoping: a job belongs to the tenant it names (its `tenant_id`, or the value of a tenant
purge); model and adapter purges belong to no tenant, so only admins and auditors see them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

import sqlalchemy as sa

from kvguard.api.deps import Access
from kvguard.api.services import Services
from kvguard.audit.erasure import PurgeEntry, engines_in
from kvguard.audit.erasure_query import CLOCK_SKEW_S, JobEvidence, Window, find_evidence
from kvguard.control.commands import PurgeKind
from kvguard.control.db import read_connection, reading
from kvguard.control.engines import EngineInfo, expected_engines
from kvguard.control.schema import EngineCommand
from kvguard.errors import NotFoundError


class PurgeStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    INCOMPLETE = "incomplete"


class PurgeEngineState(StrEnum):
    PENDING = "pending"  # expected, live, not acknowledged yet
    ACKNOWLEDGED = "acknowledged"  # acknowledged; its evidence is not all in the ledger yet
    DONE = "done"  # acknowledged, and the ledger holds its purge entry and every clear
    LOST = "lost"  # expected but gone (stopped, or no heartbeat) before finishing


@dataclass(frozen=True, slots=True)
class PurgeJob:
    job_id: int
    kind: PurgeKind
    value: str
    tenant_id: str | None  # the tenant the job belongs to (None: model and adapter purges)
    requested_by: str
    created_at: float


@dataclass(frozen=True, slots=True)
class EngineProgress:
    engine_id: str
    expected: bool
    state: PurgeEngineState
    model: str | None = None
    acknowledged_at: float | None = None
    blocks_quarantined: int | None = None
    blocks_active_deferred: int | None = None
    offload_keys: int | None = None  # data keys its purge entry must destroy (None: no tier)
    offload_keys_destroyed: int | None = None  # their key.shred entries found so far
    missing: tuple[str, ...] = ()  # what the ledger does not hold yet for this engine


@dataclass(frozen=True)
class JobReport:
    job: PurgeJob
    status: PurgeStatus
    engines: list[EngineProgress]
    evidence: JobEvidence

    @property
    def engines_expected(self) -> int:
        return sum(e.expected for e in self.engines)

    @property
    def no_live_engines(self) -> bool:
        return not self.engines

    def total(self, name: str) -> int:
        return sum(getattr(e, name) or 0 for e in self.engines)


def _job(row: Any) -> PurgeJob:
    kind = PurgeKind(row.selector_kind)
    tenant = row.selector_value if kind is PurgeKind.TENANT else row.tenant_id
    return PurgeJob(
        row.id, kind, row.selector_value, tenant, row.requested_by, float(row.created_at)
    )


def get_job(access: Access, job_id: int, conn: sa.Connection | None = None) -> PurgeJob:
    """The job, if the caller may see it (NotFoundError otherwise, as for a job that does not
    exist). On `conn` (a read connection the caller holds for the report's reads too) or its own."""
    with reading(access.services.db, conn) as c:  # autocommit: one round trip
        row = c.execute(_JOB, {"job_id": job_id}).first()
    job = _job(row) if row is not None else None
    if job is None or not access.may_see(job.tenant_id):
        raise NotFoundError(f"purge job {job_id} not found")
    return job


_JOB: Final = sa.select(EngineCommand).where(
    EngineCommand.id == sa.bindparam("job_id", type_=sa.BigInteger), EngineCommand.kind == "purge"
)  # built once: building it cost about as much CPU as running it


def list_jobs(
    services: Services,
    *,
    tenant_id: str | None,
    before: int | None,
    limit: int,
    conn: sa.Connection | None = None,
) -> list[PurgeJob]:
    """Jobs newest first, below job id `before`, of one tenant (None: every job). A tenant's page
    reads O(page) rows whatever the other tenants purged: its session purges (`tenant_id`) and its
    tenant purges (`selector_value`), each newest first along its own index
    (`ix_engine_commands_tenant`, `ix_engine_commands_selector`), merged."""
    stmt = _jobs_query(tenant=tenant_id is not None, before=before is not None)
    params = {"tenant_id": tenant_id, "before": before, "limit": limit}
    with reading(services.db, conn) as c:  # autocommit: one round trip
        return [_job(r) for r in c.execute(stmt, params).all()]


@functools.cache
def _jobs_query(*, tenant: bool, before: bool) -> Any:
    """`list_jobs`'s statement, built once per shape (building it cost about 1 ms of CPU, more
    than running it): bind parameters `tenant_id`, `before` and `limit`."""
    c = EngineCommand
    limit = sa.bindparam("limit", type_=sa.Integer)

    def newest(*where: Any) -> Any:
        stmt = sa.select(c).where(c.kind == "purge", *where)
        if before:
            stmt = stmt.where(c.id < sa.bindparam("before", type_=sa.BigInteger))
        return stmt.order_by(c.id.desc()).limit(limit)

    if not tenant:
        return newest()
    tenant_id = sa.bindparam("tenant_id", type_=sa.String)
    own = newest(c.tenant_id == tenant_id).subquery()
    whole = newest(
        c.selector_kind == PurgeKind.TENANT.value, c.selector_value == tenant_id
    ).subquery()
    both = sa.union(sa.select(own), sa.select(whole)).subquery()
    return sa.select(both).order_by(both.c.id.desc()).limit(limit)


@dataclass(frozen=True)
class _Registry:
    """The engine registry as one read sees it: every engine, the live ones, their models."""

    engines: list[EngineInfo]
    live: set[str]
    models: dict[str, str]
    max_age_s: float


@dataclass(frozen=True)
class ControlReads:
    """What a page of reports needs from the control database: the engine registry and the
    jobs' acknowledgements, read together on one connection (`control_reads`), and the time of
    that read: engines are live by their heartbeats as of then, not as of after the ledger's
    evidence is read (a slow evidence read made live engines read as lost)."""

    engines: list[EngineInfo]
    acks: dict[int, list[dict[str, Any]]]
    now: float


def control_reads(
    services: Services, jobs: Sequence[PurgeJob], conn: sa.Connection
) -> ControlReads:
    """The registry and the acknowledgements of `jobs`, on the caller's read connection (one
    checkout for the page's job rows and these two reads: a checkout and its return cost about as
    much CPU as a query, docs/benchmarks.md)."""
    engines = services.engines.engines(conn)
    now = services.clock()
    return ControlReads(engines, services.commands.acks_for([j.job_id for j in jobs], conn), now)


def job_report(access: Access, job_id: int) -> JobReport:
    """Job `job_id`'s report if the caller may see it (`get_job`): its control-database reads (the
    job, the engine registry, its acknowledgements) on one pooled connection, then its evidence."""
    with read_connection(access.services.db) as conn:
        job = get_job(access, job_id, conn)
        control = control_reads(access.services, [job], conn)
    return report(access.services, job, control)


def report(services: Services, job: PurgeJob, control: ControlReads | None = None) -> JobReport:
    """Where the job stands now (module docstring)."""
    return reports(services, [job], control)[0]


def reports(
    services: Services, jobs: Sequence[PurgeJob], control: ControlReads | None = None
) -> list[JobReport]:
    """`report` of each of `jobs` (a page of a listing) at a cost that grows with the page, not with
    the ledger or the number of jobs: the evidence through the ledger's command links (one read
    for the page, then each purge entry's clears), the engine registry read once, and every job's
    acknowledgements in one query (issue 11: 18 s for a page of 100 jobs before). `control`: those
    two reads, made by the caller on the connection it read the jobs on (read here otherwise). The
    ledger's evidence is read after them: a job is done only if every acknowledgement seen has
    its evidence, whichever order, and evidence read later is at least as complete."""
    if control is None:
        with read_connection(services.db) as conn:
            control = control_reads(services, jobs, conn)
    windows: dict[int, Window] = {}
    for job in jobs:
        created = datetime.fromtimestamp(job.created_at, UTC)
        windows[job.job_id] = (created - CLOCK_SKEW_S, created + CLOCK_SKEW_S)
    evidence = find_evidence(services.ledger, windows)
    engines = control.engines
    max_age = services.config.engine_max_age_s
    registry = _Registry(
        engines,
        live={e.engine_id for e in engines if e.live(control.now, max_age)},
        models={e.engine_id: e.model for e in engines},
        max_age_s=max_age,
    )
    acks = control.acks
    return [_report(job, evidence[job.job_id], acks.get(job.job_id, []), registry) for job in jobs]


def _report(
    job: PurgeJob, evidence: JobEvidence, ack_rows: list[dict[str, Any]], registry: _Registry
) -> JobReport:
    acks = {str(a["engine_id"]): a for a in ack_rows}
    expected = expected_engines(registry.engines, job.created_at, registry.max_age_s)
    recorded = {p.engine_id for p in evidence.purges if p.engine_id is not None}
    complete = evidenced(list(acks), evidence)
    unnamed = {e for e in acks if e not in recorded}  # what anonymous entries must stand for
    engines = []
    for engine_id in sorted(expected | set(acks) | recorded):
        ack = acks.get(engine_id)
        if engine_id in complete:
            state = PurgeEngineState.DONE
        elif engine_id in registry.live:
            state = PurgeEngineState.ACKNOWLEDGED if ack else PurgeEngineState.PENDING
        else:
            state = PurgeEngineState.LOST
        offload = _offload_keys(engine_id, evidence)
        engines.append(
            EngineProgress(
                engine_id=engine_id,
                expected=engine_id in expected,
                state=state,
                model=registry.models.get(engine_id),
                acknowledged_at=float(ack["done_at"]) if ack else None,
                blocks_quarantined=_count(ack, "blocks_quarantined"),
                blocks_active_deferred=_count(ack, "blocks_active_doomed"),
                offload_keys=offload[0] if offload else None,
                offload_keys_destroyed=offload[1] if offload else None,
                missing=()
                if state is PurgeEngineState.DONE
                else missing_evidence(
                    engine_id, ack is not None, evidence, len(unnamed | {engine_id})
                ),
            )
        )
    status = job_status([e.state for e in engines])
    if status is PurgeStatus.DONE and evidence.request is None:
        # The request's own ledger entry is still in the outbox: no certificate without it.
        status = PurgeStatus.RUNNING
    return JobReport(job, status, engines, evidence)


def _count(ack: dict[str, Any] | None, name: str) -> int | None:
    value = ack.get(name) if ack else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _purges_by_engine(
    evidence: JobEvidence,
) -> tuple[dict[str, list[PurgeEntry]], list[PurgeEntry]]:
    """The job's purge entries per named engine, and those without an engine id."""
    named: dict[str, list[PurgeEntry]] = {}
    anonymous: list[PurgeEntry] = []
    for p in evidence.purges:
        (named.setdefault(p.engine_id, []) if p.engine_id else anonymous).append(p)
    return named, anonymous


def _complete(evidence: JobEvidence, entries: Sequence[PurgeEntry]) -> bool:
    """Every block of `entries` cleared and every offload key they name shredded."""
    return not any(
        p.index in evidence.coverage.missing or p.index in evidence.offload.missing for p in entries
    )


def evidenced(acked: Sequence[str], evidence: JobEvidence) -> set[str]:
    """Acknowledging engines whose purge entries are in the ledger with every block cleared and
    every offload key shredded. Entries without an engine id (older engines) stand for the
    acknowledging engines that no entry names, one engine per purge they record
    (`erasure.engines_in`: a split entry's parts are one engine's, and counted one per entry,
    one engine's two parts stood for another engine whose purge entry was missing)."""
    named, anonymous = _purges_by_engine(evidence)
    done = {e for e in acked if e in named and _complete(evidence, named[e])}
    rest = [e for e in acked if e not in named]
    if rest and engines_in(anonymous) >= len(rest) and _complete(evidence, anonymous):
        done.update(rest)
    return done


def _offload_keys(engine_id: str, evidence: JobEvidence) -> tuple[int, int] | None:
    """(keys its purge entries must destroy, key.shred entries found for them), or None when its
    entries name no offload key. A purge entry split into parts may repeat the figure: an engine
    runs a job once, so its largest figure is the one."""
    entries = [p for p in evidence.purges if p.engine_id == engine_id and p.tier_key_count > 0]
    if not entries:
        return None
    needed = max(p.tier_key_count for p in entries)
    found = {i for p in entries for i in evidence.offload.links.get(p.index, ())}
    return needed, len(found)


def missing_evidence(
    engine_id: str, acknowledged: bool, evidence: JobEvidence, unnamed: int = 1
) -> tuple[str, ...]:
    """What is still missing before the engine's part of the job is done, in words. `unnamed`:
    how many engines (this one among them, when no entry names it) the entries without an engine
    id must stand for; fewer purges among them (`erasure.engines_in`) leave one without its
    purge entry."""
    named, anonymous = _purges_by_engine(evidence)
    entries = named.get(engine_id) or anonymous
    out = [] if acknowledged else ["acknowledgement"]
    if not entries or (engine_id not in named and engines_in(anonymous) < unnamed):
        return (*out, "purge entry in the ledger")
    blocks = sum(len(evidence.coverage.missing.get(p.index, ())) for p in entries)
    keys = max((evidence.offload.missing.get(p.index, 0) for p in entries), default=0)
    if blocks:
        out.append(f"zeroize entries for {_count_of(blocks, 'quarantined block')}")
    if keys:
        out.append(f"key.shred entries for {_count_of(keys, 'offload data key')}")
    return tuple(out)


def _count_of(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def job_status(states: Sequence[PurgeEngineState]) -> PurgeStatus:
    """The job's status from its engines' states (module docstring)."""
    if all(s is PurgeEngineState.DONE for s in states):
        return PurgeStatus.DONE
    if any(s in (PurgeEngineState.PENDING, PurgeEngineState.ACKNOWLEDGED) for s in states):
        started = any(
            s is not PurgeEngineState.PENDING and s is not PurgeEngineState.LOST for s in states
        )
        return PurgeStatus.RUNNING if started else PurgeStatus.QUEUED
    return PurgeStatus.INCOMPLETE
