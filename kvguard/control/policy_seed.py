"""One source of truth for policy: a policy file seeds the store, it never competes with it.

An engine started with a policy file and an admin API on the same database must enforce the same
policy. So when the store is empty, the file becomes its first version (author `seed`, recorded as a
`policy.change` ledger entry like every other version); from then on the store is what engines and
the API read, and `GET /v1/policies/current` is what engines enforce. When the store already holds
versions, the file is ignored and the log says so (a file that differs from the store is reported by
digest, never by content). Seeding is a compare-and-set on version 0, so engines starting together
store the file once.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from kvguard.audit.events import AuditEvent, EventKind
from kvguard.audit.ledger import Ledger
from kvguard.control.commands import CommandQueue
from kvguard.control.db import write_transaction
from kvguard.control.outbox import Outbox
from kvguard.errors import AuditError, ConfigError, PolicyVersionConflictError
from kvguard.logging import get_logger
from kvguard.policy import PolicySet, load_policy_file
from kvguard.policy.store import PolicyChange, PolicyStore

_log = get_logger("control.policy_seed")
SEED_AUTHOR = "seed"


def policy_change_event(change: PolicyChange) -> AuditEvent:
    """The `policy.change` ledger entry of a stored version (the author only in the erasable
    payload). Every writer of policy versions records them with this."""
    return AuditEvent(
        kind=EventKind.POLICY_CHANGE,
        ts=datetime.fromtimestamp(change.at, UTC),
        details={"policy_version": change.version, "digest": change.digest},
        payload={"author": change.author[:200]},
    )


def seed_from_file(store: PolicyStore, ledger: Ledger, policy_file: Path | None) -> int | None:
    """Store `policy_file` as version 1 if the store is empty; returns the version now in force
    (None: the store is empty and there is no file, so engines run the built-in defaults)."""
    current = store.current()
    if current is not None:
        if policy_file is not None:
            digest = load_policy_file(policy_file).digest()
            if digest != current.policy.digest():
                _log.warning(
                    "policy file differs from the policy store; the store is in force",
                    store_version=current.change.version,
                )
        return current.change.version
    if policy_file is None:
        return None
    policy: PolicySet = load_policy_file(policy_file)
    outbox, queue = Outbox(store.engine), CommandQueue(store.engine)
    try:
        # The version, its policy.change entry (through the outbox) and the engine command commit
        # together: a crash cannot leave a seeded version the ledger never hears of.
        with write_transaction(store.engine) as conn:
            version = store.put(
                policy,
                author=SEED_AUTHOR,
                reason=f"seeded from policy file {policy_file.name}"[:200],
                expected_version=0,
                conn=conn,
            )
            outbox.add(conn, [policy_change_event(store.current(conn=conn).change)])  # type: ignore[union-attr]
            queue.submit_policy(version, requested_by=SEED_AUTHOR, conn=conn)
    except PolicyVersionConflictError:
        latest = store.current()
        return latest.change.version if latest is not None else None
    try:
        outbox.drain(ledger)
    except (ConfigError, AuditError, SQLAlchemyError) as exc:
        # Committed in the outbox: the admin API's drain (or the next engine start) delivers it.
        _log.warning("seeded version's ledger entry left in the outbox", error=type(exc).__name__)
    _log.info("policy store seeded from the policy file", version=version)
    return version
