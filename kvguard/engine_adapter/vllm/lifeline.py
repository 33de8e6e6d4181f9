"""An engine process never outlives the process that started it.

vLLM runs its engine core (and, under it, its workers) in child processes. When the process that
started them is killed outright (`kill -9` of `kvguard engine serve`, of an application around
`GuardedLLM`), nothing tells them: they finish the requests nobody will read, keep the tenants' KV
state and offload keys in memory, and their heartbeats keep the engine registry saying that a dead
server's engine is alive, so purges count an engine nobody can reach. Each kvguard connector in a
child process therefore watches its parent: once the parent is gone (the child has been re-parented),
it asks itself to stop (SIGTERM: vLLM's own shutdown) and, if it is still there `KILL_AFTER_S`
later, ends itself.

A polling thread rather than Linux's parent-death signal: that signal follows the *thread* that
created the child, so an application that built the engine on a short-lived thread would see it
killed under it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Final

from kvguard.logging import get_logger

POLL_S: Final = 1.0
KILL_AFTER_S: Final = 10.0
_log = get_logger("vllm.lifeline")
_started = threading.Lock()
_watching: list[int] = []  # the parent pid watched (once per process)


def watch_parent() -> bool:
    """Start watching this process's parent, if it is a child process started through
    multiprocessing (vLLM's engine core and workers); False when there is nothing to watch (the
    engine runs in the application's own process). Once per process."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return False
    with _started:
        if _watching:
            return True
        _watching.append(parent.pid)
    threading.Thread(
        target=_watch, args=(parent.pid,), name="kvguard-lifeline", daemon=True
    ).start()
    return True


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    _log.warning("the process that started this engine process is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(KILL_AFTER_S)
    os.kill(os.getpid(), signal.SIGKILL)
