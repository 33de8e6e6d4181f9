"""The engine's end of the control plane: `EngineLink` (its one connection) and `CommandRunner`.

`EngineLink` is everything an engine process holds on the control database: one SQLAlchemy engine
(one pool), the command queue, the policy store and the engine registry on it, and one daemon thread,
which LISTENs for command notifications (PostgreSQL) and runs the link's chores between waits: the
command fetch and its acknowledgements, the registry keep-alive of an idle engine, the idle wake-up
check (`wakeup.IdleWaker`), and one-off writes the scheduler hands over (`call_soon`: the
heartbeats). So vLLM's step loop does no control-database round trip: a database that hangs (a
network partition, not only a refused connection) delays commands, it does not freeze the step
loop. The connector builds the link (`open_link`) and passes it into `SchedulerGuard`, which opens
nothing itself. The thread never touches custody or the pool: chores only read the database, write
acknowledgements and heartbeats, or put vLLM's no-op wake-up item on its input queue.

`CommandRunner` splits a command's life between the two threads. The link thread fetches, at most
every `LINK_FETCH_S` or at once when its PostgreSQL `CommandListener` heard a `NOTIFY` (see
`kvguard.control.commands`), and loads the policy version a policy command names from the policy
store (`policy_url`). The scheduler thread runs what was fetched at its next housekeeping (a step or
a request's arrival): purges are carried out by the scheduler guard (custody lives there), policy
versions swapped in. The link thread then writes the acknowledgements, which carry counts and
version numbers only. An in-process engine's explicit `poll` between batches does all three in the
caller's thread.

A policy version that cannot be loaded (missing, failing its digest check, or refused by this
version's validation, as in a rolling upgrade) leaves the engine on the policy it has: the last one
that loaded is known-good, and refusing every request over a bad row would let one bad write stop
every engine. The acknowledgement says so (`policy_load_failed: 1`)
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
    Command,
    CommandListener,
    CommandQueue,
    PolicyCommand,
    PurgeCommand,
    SkippedCommand,
)
from kvguard.control.db import open_engine
from kvguard.control.engines import EngineRegistry
from kvguard.engine_adapter.records import PurgeSelector
from kvguard.errors import PolicyError
from kvguard.logging import get_logger
from kvguard.policy import PolicySet
from kvguard.policy.store import PolicyStore, PolicyVersion

COMMAND_POLL_S: Final = 1.0  # an explicit `poll` (in-process engine) reads at most this often
LINK_FETCH_S: Final = 0.5  # the link thread reads at most this often (it ticks every half second)
ACK_HURRY_S: Final = 2.0  # after fetching commands the link ticks faster for this long (their acks)
_log = get_logger("vllm.commands")
# What a fetched command carries: the policy version it names (loaded on the link thread), why
# that version cannot be used, or nothing (purges, skipped commands, engines without a store).
_Loaded = PolicyVersion | PolicyError | None


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

    def clock(self) -> float:
        """The link's clock (monotonic seconds; tests pass their own)."""
        return self._clock()

    def hurry(self, seconds: float) -> None:
        """Tick every 50 ms instead of every half second for the next `seconds`."""
        self.listener.hurry(seconds)

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
        # Chores first (the command fetch is the first of them), then the one-off writes. Each is
        # on its own: one that fails is logged and retried at its next turn; the others still run.
        now = self._clock()
        with self._lock:
            due = [c for c in self._chores if now - c.last >= c.interval_s]
            for chore in due:
                chore.last = now
        for chore in due:
            try:
                chore.task()
            except Exception as exc:  # a database error, or a bug: never starve the other chores
                _log.warning("engine link chore failed; retrying", error=type(exc).__name__)
        while self._soon:
            try:
                self._soon.popleft()()
            except Exception as exc:
                _log.warning("engine link task failed", error=type(exc).__name__)

    def close(self) -> None:
        self._soon.clear()
        self.listener.close()
        self.engine.dispose()
        if self._policy_engine is not None:
            self._policy_engine.dispose()


class CommandRunner:
    """Fetches and runs engine commands for one engine (see the module docstring).

    Reading the database is the link thread's job (`fetch_if_due`, a chore of every tick): it reads
    the commands numbered after the last one fetched, loads the policy version a policy command
    names, and queues them. The scheduler thread runs what is queued (`run`), so vLLM's step loop
    never waits for the database, also when it hangs rather than refuses; the acknowledgements go
    back through the link thread (`flush_acks`, retried until written). An explicit `poll` of an
    in-process engine fetches and acknowledges in the caller's thread."""

    def __init__(self, engine_id: str, link: EngineLink) -> None:
        self.engine_id = engine_id
        self.queue = link.queue
        self._link = link
        self._last = self.queue.latest_seq()  # older commands found nothing of ours to act on
        self._fetched = self._last
        self._last_fetch = float("-inf")  # on the link's clock, whichever thread fetched
        self._fetch_lock = threading.Lock()
        self.ready: deque[tuple[Command | SkippedCommand, _Loaded]] = deque()
        self._queued = 0  # commands fetched so far (the link thread's wake-up test)
        self._acks: deque[tuple[int, dict[str, Any]]] = deque()
        self._ack_lock = threading.Lock()
        self.store = link.policies
        self.executed = 0
        # Called on the link thread when a fetch queued commands (the guard wakes an idle engine).
        self.on_fetched: Callable[[], None] | None = None

    @property
    def last_seq(self) -> int:
        """The number of the newest command this engine has run (or skipped as older than itself,
        or as unreadable by this version)."""
        return self._last

    def due(self) -> bool:
        """True if fetched commands wait to run (no database access)."""
        return bool(self.ready)

    def fetch_if_due(self, interval_s: float = COMMAND_POLL_S) -> int:
        """Fetch new commands if one was announced (PostgreSQL NOTIFY) or `interval_s` has passed
        on the link's clock since the last fetch; returns how many were queued. Database errors
        propagate (the caller logs them; the next fetch reads from the first command not queued)."""
        with self._fetch_lock:
            now = self._link.clock()
            if not (self._link.take_notified() or now - self._last_fetch >= interval_s):
                return 0
            self._last_fetch = now
            fetched = 0
            for command in self.queue.pending_after(self._fetched):
                self.ready.append((command, self._load(command)))
                self._fetched = command.seq
                self._queued += 1
                fetched += 1
            return fetched

    def _load(self, command: Command | SkippedCommand) -> _Loaded:
        """The policy version a policy command names, or why it cannot be used (acknowledged as a
        failed load when the command runs). A database error propagates: the fetch is retried."""
        if not isinstance(command, PolicyCommand) or self.store is None:
            return None
        try:
            return self.store.get(command.version)
        except sa.exc.SQLAlchemyError:
            raise
        except PolicyError as exc:  # missing, failing its digest, or refused by this version
            return exc
        except Exception as exc:  # a document this version cannot read: never wedge the link
            return PolicyError(f"policy version could not be read ({type(exc).__name__})")

    def poll(self, now: float, target: CommandTarget) -> int:
        """Fetch, run and acknowledge in the caller's thread (an in-process engine between batches);
        returns how many ran. A database that cannot be reached is logged and tried again later."""
        try:
            self.fetch_if_due()
        except sa.exc.SQLAlchemyError as exc:
            _log.warning("command poll failed; retrying at the next poll", error=type(exc).__name__)
        ran = self.run(now, target)
        try:
            self.flush_acks()
        except sa.exc.SQLAlchemyError as exc:
            _log.warning("command acknowledgement failed; retrying", error=type(exc).__name__)
        return ran

    def run(self, now: float, target: CommandTarget) -> int:
        """Run every fetched command, in number order; returns how many ran. Touches no database:
        the acknowledgements wait for `flush_acks`. A command whose run raises stays first in line
        and runs again at the next call (a purge run twice quarantines nothing more); a full ledger
        queue does not make a purge raise: its entries wait in the scheduler (`_forward`)."""
        ran = 0
        while self.ready:
            command, loaded = self.ready[0]
            if isinstance(command, SkippedCommand):
                _log.error(
                    "engine command this version cannot read; skipped, not acknowledged",
                    command_id=command.id,
                    kind=command.kind,
                )
                self.ready.popleft()
                self._last = command.seq
                continue
            if isinstance(command, PurgeCommand):
                result: dict[str, Any] = target.purge_for_command(command.selector, now, command.id)
            else:
                result = self._policy(command, loaded, target)
            self.ready.popleft()
            self._acks.append((command.id, result))
            self._last = command.seq
            ran += 1
        self.executed += ran
        return ran

    def flush_acks(self) -> int:
        """Write the queued acknowledgements, oldest first (link thread, or `poll`); one that fails
        stays queued for the next call and the error propagates."""
        written = 0
        with self._ack_lock:
            while self._acks:
                command_id, result = self._acks[0]
                self.queue.acknowledge(command_id, self.engine_id, result)
                self._acks.popleft()
                written += 1
        return written

    def close(self, timeout_s: float = 2.0) -> None:
        """Write the acknowledgements still queued (best effort, waiting at most `timeout_s` for a
        write in progress on the link thread: the engine is stopping)."""
        if self.ready:
            _log.warning("engine stopping with fetched commands not run", commands=len(self.ready))
        if not self._ack_lock.acquire(timeout=timeout_s):
            _log.warning("acknowledgements not written at shutdown", acks=len(self._acks))
            return
        self._ack_lock.release()
        try:
            self.flush_acks()
        except sa.exc.SQLAlchemyError as exc:
            _log.warning("acknowledgements lost at shutdown", error=type(exc).__name__)

    def fetch_chore(self) -> None:
        """The link thread's first chore: fetch what is new; if anything was queued, wake an idle
        engine and tick fast until its acknowledgements are written."""
        queued = self._queued
        try:
            self.fetch_if_due(LINK_FETCH_S)
        finally:
            if self._queued > queued:  # also for a fetch that failed after queueing some
                self._link.hurry(ACK_HURRY_S)
                if self.on_fetched is not None:
                    self.on_fetched()

    def _policy(
        self,
        command: PolicyCommand,
        loaded: _Loaded,
        target: CommandTarget,
    ) -> dict[str, Any]:
        if self.store is None:
            return {"policy_version": None}
        current = target.policy_version
        if current is not None and command.version <= current:
            return {"policy_version": current}  # versions only grow; never go back to an older one
        if not isinstance(loaded, PolicyVersion):
            _log.error(
                "policy version could not be loaded; keeping the current policy",
                version=command.version,
                error=type(loaded).__name__,
            )
            return {"policy_version": current, "policy_load_failed": 1}
        target.use_policy(loaded.policy, loaded.change.version)
        _log.info("policy version applied", version=loaded.change.version)
        return {"policy_version": loaded.change.version}
