"""The non-blocking write path: a bounded in-memory queue drained by one group-committing thread.

`submit` is what an engine calls on its hot path: it appends to a deque under a lock (no I/O, no
encoding) and returns. A background thread commits the queue in groups (every `interval` seconds or
`batch_size` events, whichever first) through the synchronous, durable `append_many`.

A queued entry is an `AuditEvent` or an `EventSource`: the fact in the caller's own terms, turned
into validated `AuditEvent`s on the writer thread (`expand`), so an engine's scheduler pays for a
deque append, not for building and validating entries. A source never raises: what the schema refuses
it records in a redacted form (see `kvguard.engine_adapter.ledger_bridge`).

On a host with few cores the commits compete with the caller's own work (an engine's forward
passes). `nice` lowers the writer thread's CPU priority (Linux: the thread's nice value), so its
commits take the cycles the caller leaves idle; entries then wait longer in the queue while the
host is saturated (more of them lost if the process is killed meanwhile; `flush` waits for them).

Never silent loss: events leave the queue only after their group committed. When the database
fails, the writer keeps them and retries with backoff; the queue fills, and then the overflow policy
decides: `block` makes `submit` wait for room, `fail_closed` raises `LedgerUnavailableError` so that
the caller refuses the work it wanted to record (G7).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Protocol

from kvguard.audit.events import AuditEvent
from kvguard.errors import LedgerUnavailableError
from kvguard.logging import get_logger

_log = get_logger("kvguard.audit.writer")
_MAX_BACKOFF_S = 1.0
MAX_NICE = 19  # the lowest priority Linux gives a thread


def lower_thread_priority(nice: int) -> bool:
    """Lower the calling thread's CPU priority to `nice` (0-19; never raises it, which would need
    privileges). Linux only: elsewhere, and when the system refuses, nothing changes and the
    result is False (logged)."""
    check_nice(nice)
    if nice == 0:
        return True
    if not sys.platform.startswith("linux"):
        # Elsewhere PRIO_PROCESS with a thread id would name a process: never guessed.
        _log.warning("ledger writer priority not lowered: only supported on Linux")
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as exc:
        _log.warning("ledger writer priority not lowered", error=exc.__class__.__name__)
        return False
    return True


def check_nice(nice: object) -> None:
    """ValueError unless `nice` is a whole number 0-19."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= MAX_NICE:
        raise ValueError(f"a thread's nice value is a whole number 0-{MAX_NICE}, not {nice!r}")


class EventSource(Protocol):
    """A fact queued for the ledger whose `AuditEvent`s are built on the writer thread."""

    def audit_events(self) -> Sequence[AuditEvent]:
        """The entries this fact becomes (in order). Must not raise: the writer retries a batch that
        fails, so a source that cannot be recorded as it is records a redacted form instead."""
        ...


Entry = AuditEvent | EventSource


def expand(entries: Iterable[Entry]) -> list[AuditEvent]:
    """The `AuditEvent`s of queued entries, in queue order."""
    out: list[AuditEvent] = []
    for entry in entries:
        if isinstance(entry, AuditEvent):
            out.append(entry)
        else:
            out.extend(entry.audit_events())
    return out


class Overflow(StrEnum):
    """What `submit` does when the queue is full."""

    BLOCK = "block"
    FAIL_CLOSED = "fail_closed"


class BackgroundWriter:
    """Owns the submit queue and its commit thread."""

    def __init__(
        self,
        write: Callable[[Sequence[Entry]], object],
        *,
        capacity: int = 100_000,
        batch_size: int = 1_000,
        interval: float = 0.05,
        overflow: Overflow = Overflow.BLOCK,
        nice: int = 0,
    ) -> None:
        if capacity < batch_size or batch_size < 1:
            raise ValueError("capacity must be at least batch_size, which must be positive")
        check_nice(nice)  # here: a bad value raised on the thread would stop the writer
        self._nice = nice
        self._write = write
        self._capacity = capacity
        self._batch_size = batch_size
        self._interval = interval
        self._overflow = Overflow(overflow)
        self._queue: deque[Entry] = deque()
        self._cond = threading.Condition()
        self._submitted = 0
        self._durable = 0
        self._closed = False
        self._failing = False
        self._urgent = False
        self._thread = threading.Thread(target=self._run, name="kvguard-ledger-writer", daemon=True)
        self._thread.start()

    def submit(self, event: Entry) -> None:
        """Enqueue `event` for a group commit. Raises LedgerUnavailableError under `fail_closed`
        when the queue is full, or when the writer is closed."""
        self.submit_many((event,))

    def submit_many(self, events: Sequence[Entry], *, wait: bool = True) -> None:
        """Enqueue `events` in order, taking the lock once (an engine step's entries). Under
        `fail_closed` a queue without room for all of them refuses all of them; under `block` the
        call waits for room (a group larger than the whole queue is let in once the queue is empty).
        `wait=False` refuses instead of waiting under either policy: a caller that must never wait
        on the database (vLLM's scheduler thread) keeps what was refused and submits it later."""
        if not events:
            return
        with self._cond:
            if self._closed:
                raise LedgerUnavailableError("the ledger writer is closed")
            room = max(self._capacity - len(events), 0)
            while len(self._queue) > room:
                if self._overflow is Overflow.FAIL_CLOSED or not wait:
                    raise LedgerUnavailableError(
                        f"ledger queue full ({self._capacity} events not yet durable): refusing work"
                    )
                self._cond.wait()
                if self._closed:
                    raise LedgerUnavailableError("the ledger writer is closed")
            before = len(self._queue)
            self._queue.extend(events)
            self._submitted += len(events)
            # Start the timer (the queue was empty) or wake the writer for a full group.
            if before == 0 or (before < self._batch_size <= len(self._queue)):
                self._cond.notify_all()

    def refusing(self) -> bool:
        """Whether one more entry would be refused now, or (`block`) have to wait for room: closed,
        or a full queue. Queues nothing: an engine asks before it starts new work (G7), and a
        full queue under `block` means the ledger is not taking entries either."""
        with self._cond:
            return self._closed or len(self._queue) >= self._capacity

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def flush(self, timeout: float | None = 30.0) -> None:
        """Return once every event submitted before this call is durable; raise
        LedgerUnavailableError if that does not happen within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._submitted
            self._urgent = True
            self._cond.notify_all()
            while self._durable < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    state = "failing" if self._failing else "slow"
                    raise LedgerUnavailableError(
                        f"ledger not durable after {timeout} s ({target - self._durable} events "
                        f"pending, writer {state})"
                    )
                self._cond.wait(left)

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush, then stop the thread. Idempotent."""
        if not self._closed:
            self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _next_batch(self) -> list[Entry] | None:
        """Wait for a group: `batch_size` events, `interval` seconds, a flush, or close."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            deadline = time.monotonic() + self._interval
            while len(self._queue) < self._batch_size and not (self._closed or self._urgent):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._urgent = False
            if not self._queue:
                return None
            return list(itertools.islice(self._queue, self._batch_size))

    def _run(self) -> None:
        try:
            lower_thread_priority(self._nice)
        except Exception as exc:  # a priority is an optimisation: never lose the writer over it
            _log.warning("ledger writer priority not lowered", error=exc.__class__.__name__)
        backoff = 0.01
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._write(batch)
            except Exception as exc:  # keep the events, retry: never drop evidence
                _log.error(
                    "ledger write failed; retrying",
                    error=exc.__class__.__name__,
                    pending=len(batch),
                )
                with self._cond:
                    self._failing = True
                time.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            backoff = 0.01
            with self._cond:
                for _ in batch:
                    self._queue.popleft()
                self._durable += len(batch)
                self._failing = False
                self._cond.notify_all()


class PeriodicTask:
    """Runs `task` every `interval` seconds on a daemon thread until `stop()`."""

    def __init__(self, interval: float, task: Callable[[], object], name: str) -> None:
        self._interval = interval
        self._task = task
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._task()
            except Exception as exc:
                _log.error("periodic ledger task failed", error=exc.__class__.__name__)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
