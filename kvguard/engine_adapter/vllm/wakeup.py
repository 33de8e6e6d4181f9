"""Wake an idle vLLM engine when it has kvguard work: a new command, or cached blocks to expire.

vLLM's engine-core process blocks on its input queue while it has no requests, so no scheduler code
runs: a purge queued through the database, or a TTL that runs out, would wait for the next request
and the tenant's bytes would stay in device memory until then. `IdleWaker.check` runs on the engine
link's thread (`EngineLink.every`, once a second) in the engine-core process: it looks for a command
newer than the last one the engine ran (one indexed `max(seq)` read on the link's pool), for a
heartbeat that is due while figures changed since the last one (the engine went idle right after
a burst: without a step its figures never reached the registry and `/metrics`), and, while
blocks are cached, every `EXPIRY_WAKE_S` for expiry. When there is work it raises the guard's wake flag (which
`has_pending_push_work` reports, so the engine keeps stepping) and puts vLLM's own no-op
`WAKEUP` request on the input queue, which unblocks the loop; the next step runs the guard's
housekeeping in the scheduler thread as usual. The check never touches custody or the block pool.

Coupling, on purpose and checked by tests: the queue is found by walking up the frames that are
constructing the connector to the `EngineCoreProc` (an object with an `input_queue` that is a
`queue.Queue`), and the item is `(EngineCoreRequestType.WAKEUP, None)`. An in-process engine
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) has no such loop: it steps only when its caller does, and
`GuardedLLM` runs housekeeping before each batch; there `attach` returns None.
"""

from __future__ import annotations

import inspect
import queue
import time
from collections.abc import Callable
from typing import Any, Final

from kvguard.control.commands import CommandQueue
from kvguard.logging import get_logger

WAKE_CHECK_S: Final = 1.0
EXPIRY_WAKE_S: Final = 5.0
_log = get_logger("vllm.wakeup")


def find_engine_input_queue() -> queue.Queue[Any] | None:
    """The input queue of the vLLM engine-core process constructing us, or None (in-process)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            found = getattr(candidate, "input_queue", None)
            if isinstance(found, queue.Queue):
                return found
            frame = frame.f_back
        return None
    finally:
        del frame  # frames reference their locals: do not keep the chain alive


def _wakeup_item() -> tuple[Any, None]:
    from vllm.v1.engine import EngineCoreRequestType  # noqa: PLC0415 (vLLM is imported by now)

    return (EngineCoreRequestType.WAKEUP, None)


class IdleWaker:
    """The idle wake-up check (see the module docstring); `check` runs on the engine link's thread."""

    def __init__(
        self,
        input_queue: queue.Queue[Any],
        *,
        commands: CommandQueue,
        last_command: Callable[[], int],
        cached_blocks: Callable[[], int],
        request_wake: Callable[[], None],
        figures_stale: Callable[[], bool] = lambda: False,
        item: Any = None,
        expiry_s: float = EXPIRY_WAKE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._queue = input_queue
        self._figures_stale = figures_stale
        self._commands = commands
        self._last_command = last_command
        self._cached_blocks = cached_blocks
        self._request_wake = request_wake
        self._item = item if item is not None else _wakeup_item()
        self._expiry_s, self._clock = expiry_s, clock
        self._last_expiry_wake = clock()
        self.wakes = 0

    @classmethod
    def attach(
        cls,
        *,
        commands: CommandQueue,
        last_command: Callable[[], int],
        cached_blocks: Callable[[], int],
        request_wake: Callable[[], None],
        figures_stale: Callable[[], bool] = lambda: False,
    ) -> IdleWaker | None:
        """A waker for the engine-core process constructing us; None for an in-process engine."""
        found = find_engine_input_queue()
        if found is None:
            return None
        return cls(
            found,
            commands=commands,
            last_command=last_command,
            cached_blocks=cached_blocks,
            request_wake=request_wake,
            figures_stale=figures_stale,
        )

    def _due(self) -> bool:
        if self._commands.latest_seq() > self._last_command():
            return True
        if self._figures_stale():  # steps ran since the last heartbeat, and one is due
            return True
        expiry_due = self._clock() - self._last_expiry_wake >= self._expiry_s
        return expiry_due and self._cached_blocks() > 0

    def check(self) -> bool:
        """Wake the engine if it has work; True if it did. Database errors propagate (the link logs
        them and tries again at the next check)."""
        if not self._due():
            return False
        self._last_expiry_wake = self._clock()
        self.wake()
        return True

    def wake(self) -> None:
        """Make the engine step now (the link thread just fetched commands for it)."""
        self._request_wake()
        self._queue.put_nowait(self._item)
        self.wakes += 1
