"""`admin.action` ledger entries: every mutating API call and every export, with who, what, outcome.

The entry is appended durably before the API answers, so a change the ledger could not record is not
reported as done (G5). Refused and failed calls by authenticated callers are recorded too (outcome
`denied`, `invalid`, `conflict`, `not_found`, `failed`); unauthenticated calls are only logged and
rate-limited, so that nobody without a key can grow the ledger.

The leaf carries the tenant's `tt_` tag (never its id); the tenant id lives in the erasable payload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from prometheus_client import Histogram

from kvguard.api.auth import Principal
from kvguard.audit.events import AuditEvent, DetailValue, EventKind
from kvguard.audit.ledger import Ledger
from kvguard.control.policy_seed import policy_change_event
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
        append_seconds: Histogram | None = None,
    ) -> None:
        self._ledger = ledger
        self._deriver = deriver
        self._clock = clock
        self._append_seconds = append_seconds

    def _append(self, event: AuditEvent) -> int:
        start = time.perf_counter()
        index = self._ledger.append(event)
        if self._append_seconds is not None:
            self._append_seconds.observe(time.perf_counter() - start)
        return index

    def tenant_tag(self, tenant_id: str) -> str:
        return self._deriver.tenant_tag(tenant_id)

    def policy_change(self, change: PolicyChange) -> int:
        """The `policy.change` entry for a stored version (written right after the store commits:
        on SQLite the ledger cannot be written from inside the policy store's write transaction)."""
        event = policy_change_event(change)
        return self._append(event)

    def record(
        self,
        principal: Principal,
        action: str,
        outcome: str,
        *,
        tenant_id: str | None = None,
        target: dict[str, DetailValue] | None = None,
    ) -> int:
        """Append one `admin.action` entry; returns its ledger index once durable."""
        event = AuditEvent(
            kind=EventKind.ADMIN_ACTION,
            scope_tag=self.tenant_tag(tenant_id) if tenant_id else None,
            ts=datetime.fromtimestamp(self._clock(), UTC),
            details={
                "principal": principal.name,
                "role": principal.role.value,
                "action": action,
                "outcome": outcome,
                **(target or {}),
            },
            payload={"tenant_id": tenant_id} if tenant_id else None,
        )
        index = self._append(event)
        _log.info("admin action", action=action, outcome=outcome, principal=principal.name)
        return index
