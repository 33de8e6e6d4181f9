"""The engine's end of the control plane: `EngineLink` (its one connection) and `CommandRunner`.

`EngineLink` is everything an engine process holds on the control database: one SQLAlchemy engine
(one pool), the command queue, the policy store and the engine registry on it, and one daemon thread,
which LISTENs for command notifications (PostgreSQL) and runs the link's chores between waits: the
registry keep-alive of an idle engine, the idle wake-up check (`wakeup.IdleWaker`), and one-off
writes the scheduler hands over (`call_soon`: the heartbeats, so the step loop does no database
round trip for them). The connector
builds it (`open_link`) and passes it into `SchedulerGuard`, which opens nothing itself. The thread
never touches custody or the pool: chores only read the database, move `last_seen` on, or put vLLM's
no-op wake-up item on its input queue.

`CommandRunner` runs in the scheduler thread. It polls at most every `COMMAND_POLL_S`, or at once when
its PostgreSQL `CommandListener` heard a `NOTIFY` (see `kvguard.control.commands`). Purges are
carried out by the scheduler guard (custody lives there); policy commands load the named version from
the policy store (`policy_url`), and the guard swaps it in. Acknowledgements carry counts and version
numbers only.

A policy version that cannot be loaded (missing, or failing its digest check) leaves the engine on
the policy it has: the last one that loaded is known-good, and refusing every request over a bad row
would let one bad write stop every engine. The acknowledgement says so (`policy_load_failed: 1`)
and the error is logged. An engine without `policy_url` follows its policy file only and acknowledges
policy commands with `policy_version: null`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import sqlalchemy as sa

from kvguard.control.commands import (
    CommandListener,
    CommandQueue,
    PolicyCommand,
    PurgeCommand,
)
from kvguard.control.db import open_engine
from kvguard.control.engines import EngineRegistry
from kvguard.engine_adapter.records import PurgeSelector
from kvguard.errors import PolicyStoreError
from kvguard.logging import get_logger
from kvguard.policy import PolicySet
from kvguard.policy.store import PolicyStore

COMMAND_POLL_S: Final = 1.0
_log = get_logger("vllm.commands")


class CommandTarget(Protocol):
    """What a command acts on: the scheduler guard."""

    policy_version: int | None

    def purge_for_command(
        self, selector: PurgeSelector, now: float, command_id: int
    ) -> dict[str, int]: ...

    def use_policy(self, policies: PolicySet, version: int) -> None: ...


@dataclass
class _Chore:
    interval_s: float
    task: Callable[[], object]
    last: float = float("-inf")


class EngineLink:
    """An engine process's one connection to the control database (module docstring)."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        policy_engine: sa.Engine | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.queue = CommandQueue(engine)
        self.registry = EngineRegistry(engine)
        # The policy store lives on the control database unless configured elsewhere.
        self._policy_engine = policy_engine
        self.policies: PolicyStore | None = PolicyStore(policy_engine or engine)
        self._clock = clock
        self._chores: list[_Chore] = []
        self._soon: deque[Callable[[], object]] = deque()
        self._lock = threading.Lock()
        self.listener = CommandListener(engine, tick=self._tick)
        self._started = False

    @classmethod
    def open(cls, control_url: str, policy_url: str | None = None) -> EngineLink:
        engine = open_engine(control_url)
        other = policy_url is not None and policy_url != control_url
        link = cls(engine, policy_engine=open_engine(policy_url) if other and policy_url else None)
        if policy_url is None:
            link.policies = None  # the engine follows its policy file only
        return link

    def every(self, interval_s: float, task: Callable[[], object]) -> None:
        """Run `task` on the link's thread every `interval_s` seconds (errors are logged)."""
        with self._lock:
            self._chores.append(_Chore(interval_s, task))

    def call_soon(self, task: Callable[[], object]) -> None:
        """Run `task` once on the link's thread, at its next tick (at most half a second), in the
        order handed over; a database error is logged. Tasks still queued at `close` are dropped."""
        self._soon.append(task)

    def start(self) -> EngineLink:
        if not self._started:
            self._started = True
            self.listener.start()
        return self

    def take_notified(self) -> bool:
        """True if a command was announced since the last call (PostgreSQL NOTIFY)."""
        return self.listener.take()

    def _tick(self) -> None:
        while self._soon:
            try:
                self._soon.popleft()()
            except sa.exc.SQLAlchemyError as exc:
                _log.warning("engine link task failed", error=type(exc).__name__)
        now = self._clock()
        with self._lock:
            due = [c for c in self._chores if now - c.last >= c.interval_s]
            for chore in due:
                chore.last = now
        for chore in due:
            try:
                chore.task()
            except sa.exc.SQLAlchemyError as exc:
                _log.warning("engine link chore failed; retrying", error=type(exc).__name__)

    def close(self) -> None:
        self._soon.clear()
        self.listener.close()
        self.engine.dispose()
        if self._policy_engine is not None:
            self._policy_engine.dispose()


class CommandRunner:
    """Polls and runs engine commands for one engine (see the module docstring)."""

    def __init__(self, engine_id: str, link: EngineLink) -> None:
        self.engine_id = engine_id
        self.queue = link.queue
        self._link = link
        self._last = self.queue.latest_seq()  # older commands found nothing of ours to act on
        self._last_poll = float("-inf")
        self.store = link.policies
        self.executed = 0

    @property
    def last_seq(self) -> int:
        """The number of the newest command this engine has run (or skipped as older than itself)."""
        return self._last

    def due(self, now: float) -> bool:
        return self._link.take_notified() or now - self._last_poll >= COMMAND_POLL_S

    def run(self, now: float, target: CommandTarget) -> int:
        """Run every command created since the last one run; returns how many ran. A database that
        cannot be reached is logged and tried again at the next poll: it never stops the engine
        (this runs in vLLM's scheduler thread, where an exception kills the engine core)."""
        self._last_poll = now
        try:
            return self._run(now, target)
        except sa.exc.SQLAlchemyError as exc:
            _log.warning("command poll failed; retrying at the next poll", error=type(exc).__name__)
            return 0

    def _run(self, now: float, target: CommandTarget) -> int:
        ran = 0
        for command in self.queue.pending_after(self._last):
            if isinstance(command, PurgeCommand):
                result: dict[str, Any] = target.purge_for_command(command.selector, now, command.id)
            else:
                result = self._policy(command, target)
            self.queue.acknowledge(command.id, self.engine_id, result)
            self._last = command.seq
            ran += 1
        self.executed += ran
        return ran

    def _policy(self, command: PolicyCommand, target: CommandTarget) -> dict[str, Any]:
        if self.store is None:
            return {"policy_version": None}
        current = target.policy_version
        if current is not None and command.version <= current:
            return {"policy_version": current}  # versions only grow; never go back to an older one
        try:
            loaded = self.store.get(command.version)
        except PolicyStoreError as exc:
            _log.error(
                "policy version could not be loaded; keeping the current policy",
                version=command.version,
                error=str(exc),
            )
            return {"policy_version": current, "policy_load_failed": 1}
        target.use_policy(loaded.policy, loaded.change.version)
        _log.info("policy version applied", version=loaded.change.version)
        return {"policy_version": loaded.change.version}
