"""`admin.action` ledger entries: every mutating API call and every export, with who, what, outcome.

A change's entry is written to the control outbox in the change's own transaction (`event` + the
route's `conn`), so the change and its evidence commit together or not at all, and it is drained into
the ledger before the API answers (`Services.deliver`); should the ledger be unreachable then, the
entry stays committed in the outbox and the background drain delivers it (G5). Refused and failed calls by authenticated callers are recorded too (outcome
`denied`, `invalid`, `conflict`, `not_found`, `failed`); unauthenticated calls are only logged and
rate-limited, so that nobody without a key can grow the ledger.

The leaf carries the tenant's `tt_` tag (never its id); the tenant id lives in the erasable payload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import sqlalchemy as sa
from prometheus_client import Histogram

from kvguard.api.auth import Principal
from kvguard.audit.events import AuditEvent, DetailValue
from kvguard.audit.ledger import Ledger
from kvguard.control.db import write_transaction
from kvguard.control.outbox import Outbox, admin_action_event
from kvguard.control.policy_seed import policy_change_event
from kvguard.errors import KvguardError
from kvguard.isolation.salts import SaltDeriver
from kvguard.logging import get_logger
from kvguard.policy.store import PolicyChange

_log = get_logger("kvguard.api.actions")


class ActionLog:
    def __init__(
        self,
        ledger: Ledger,
        deriver: SaltDeriver,
        clock: Callable[[], float],
        *,
        outbox: Outbox,
        append_seconds: Histogram | None = None,
    ) -> None:
        self._ledger = ledger
        self.outbox = outbox
        # How an entry recorded on its own is delivered (Services points it at its delivery thread).
        self.deliver_hook: Callable[[], bool] = self.try_deliver
        self._deriver = deriver
        self._clock = clock
        self._append_seconds = append_seconds

    def deliver(self) -> int:
        """Drain the outbox into the ledger (every pending event, exactly once); returns how many
        were appended. Raises when the ledger cannot be written (the events stay pending)."""
        start = time.perf_counter()
        appended = self.outbox.drain(self._ledger)
        if appended and self._append_seconds is not None:
            self._append_seconds.observe(time.perf_counter() - start)
        return appended

    def tenant_tag(self, tenant_id: str) -> str:
        return self._deriver.tenant_tag(tenant_id)

    def try_deliver(self) -> bool:
        """`deliver`, or False (logged) when the ledger cannot be written now: the events are
        committed in the outbox, and the next drain delivers them."""
        try:
            self.deliver()
        except (sa.exc.SQLAlchemyError, KvguardError, OSError) as exc:
            _log.warning("ledger delivery deferred", error_type=type(exc).__name__)
            return False
        return True

    def policy_change(self, conn: sa.Connection, change: PolicyChange) -> None:
        """Queue the `policy.change` entry of a version stored in `conn`'s transaction."""
        self.outbox.add(conn, [policy_change_event(change)])

    def record(
        self,
        principal: Principal,
        action: str,
        outcome: str,
        *,
        tenant_id: str | None = None,
        target: dict[str, DetailValue] | None = None,
        conn: sa.Connection | None = None,
    ) -> None:
        """Queue one `admin.action` entry: in `conn`'s transaction, or (no state change to commit
        with: refusals, exports) in a transaction of its own, delivered at once."""
        event = self.event(principal, action, outcome, tenant_id=tenant_id, target=target)
        if conn is not None:
            self.outbox.add(conn, [event])
        else:
            with write_transaction(self.outbox.engine) as own:
                self.outbox.add(own, [event])
            self.deliver_hook()
        self.log(principal, action, outcome)

    def log(self, principal: Principal, action: str, outcome: str) -> None:
        _log.info("admin action", action=action, outcome=outcome, principal=principal.name)

    def event(
        self,
        principal: Principal,
        action: str,
        outcome: str,
        *,
        tenant_id: str | None = None,
        target: dict[str, DetailValue] | None = None,
    ) -> AuditEvent:
        return admin_action_event(
            principal.name,
            principal.role.value,
            action,
            outcome,
            ts=datetime.fromtimestamp(self._clock(), UTC),
            scope_tag=self.tenant_tag(tenant_id) if tenant_id else None,
            tenant_id=tenant_id,
            details=target,
        )
