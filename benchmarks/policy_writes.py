"""The policy writer's CPU per write when two API processes write to one PostgreSQL database (issue 11,
item 10). Results go to docs/benchmarks.md ("Control plane under load").

    .venv/bin/python benchmarks/policy_writes.py [--db URL] [--tenants 64] [--writes 1200] [--group 3]

Two `PolicyPublisher`s, each with its own engine and `PolicyStore`, stand for two `kvguard serve`
processes. One thread alternates between them, a group of `--group` writes each time, so every group
finds the policy head moved by the other "process" (its base and the versions it checks limits
against were written there), as under `control_load.py --workers 2`. The writes are the load
benchmark's: a third admins setting one tenant's retention (its limits), two thirds tenant_admins
tightening their own tenant, each checked against its limits as the API's edit checks it. The same
interleaving runs every time (seeded), so two code versions can be compared run against run: the
CPU seconds of the writing thread per write (the database's own work is not in it) and, for scale,
a whole parse of the final document. Prints a short table last."""

from __future__ import annotations

import argparse
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import sqlalchemy as sa

from kvguard.api.routes.policies import edit_tenant
from kvguard.audit.events import AuditEvent, EventKind
from kvguard.control.commands import CommandQueue
from kvguard.control.db import open_engine
from kvguard.control.outbox import Outbox
from kvguard.control.publish import PolicyBase, PolicyPublisher, PolicyWrite
from kvguard.policy import PolicySet, PolicyStore, TenantPolicy
from kvguard.policy.loading import parse_policy
from kvguard.policy.store import PolicyChange
from kvguard.policy.tighten import loosened

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextmanager
def fresh_database(url: str) -> Iterator[str]:
    name = f"kvg_pw_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield sa.engine.make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def publisher(url: str) -> PolicyPublisher:
    engine = open_engine(url)
    return PolicyPublisher(PolicyStore(engine), Outbox(engine), CommandQueue(engine))


def events(change: PolicyChange) -> list[AuditEvent]:
    return [
        AuditEvent(
            kind=EventKind.ADMIN_ACTION,
            ts=datetime.now(UTC),
            details={"action": "bench", "policy_version": change.version},
        )
    ]


def set_retention(tenant: str, ttl: int, idle: int, *, check: bool):  # type: ignore[no-untyped-def]
    """The API's edit of one tenant's entry; `check`: a tenant_admin's, against its limits."""
    entry = TenantPolicy.model_validate({"retention": {"ttl_s": ttl, "idle_s": idle}})

    def edit(base: PolicyBase) -> PolicySet:
        def change(_old: TenantPolicy) -> TenantPolicy:
            if check and loosened(base.limit_for(tenant), entry):
                raise PermissionError("looser than the limits")
            return entry

        return edit_tenant(tenant, change)(base.current)

    return edit


def writes(r: random.Random, tenants: list[str], n: int) -> list[PolicyWrite]:
    out = []
    for _ in range(n):
        tenant = r.choice(tenants)
        if r.random() < 2 / 3:
            edit = set_retention(tenant, 1800, 120, check=True)
            out.append(PolicyWrite(edit, "key:t", "bench", "tenant_admin", events))
        else:
            edit = set_retention(
                tenant, r.randrange(3000, 3601), r.randrange(300, 601), check=False
            )
            out.append(PolicyWrite(edit, "key:a", "bench", "admin", events, limits_of=tenant))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=PG_URL, help="PostgreSQL URL of a database to create in")
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--writes", type=int, default=1200)
    parser.add_argument("--group", type=int, default=3, help="writes per group commit")
    args = parser.parse_args()
    tenants = [f"tenant-{i:03d}" for i in range(args.tenants)]
    with fresh_database(args.db) as url:
        one, two = publisher(url), publisher(url)
        seed = PolicySet.model_validate(
            {"tenants": {t: {"retention": {"ttl_s": 3600, "idle_s": 600}} for t in tenants}}
        )
        one.publish(
            lambda _b: seed, author="key:a", reason="seed", author_role="admin", events=events
        )
        r = random.Random(11)
        refused = stored = 0
        cpu = 0.0
        wall = time.perf_counter()
        for n in range(0, args.writes, args.group):
            group = writes(r, tenants, min(args.group, args.writes - n))
            side = one if (n // args.group) % 2 else two
            started = time.thread_time()
            outcomes = side.publish_group(group)
            cpu += time.thread_time() - started
            refused += sum(isinstance(o, Exception) for o in outcomes)
            stored += sum(not isinstance(o, Exception) for o in outcomes)
            if n % 300 < args.group:
                print(f"  {n + len(group)} writes, {stored} stored, {refused} refused")
        wall = time.perf_counter() - wall
        current = PolicyStore(open_engine(url)).current()
        assert current is not None
        document = current.policy.canonical_json()
        started = time.thread_time()
        for _ in range(20):
            parse_policy(document, "bench", fmt="json")
        parse_ms = (time.thread_time() - started) / 20 * 1e3
    print()
    print(
        "| writes | stored | refused | tenants | group | CPU ms per write | wall s | whole parse ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.writes} | {stored} | {refused} | {args.tenants} | {args.group} "
        f"| {cpu / args.writes * 1e3:.3f} | {wall:.1f} | {parse_ms:.3f} |"
    )


if __name__ == "__main__":
    main()
