"""`OneHopRoute`: every route's work on a worker thread in one hop, its answer built on the loop.

FastAPI runs a plain `def` route on a worker thread, and then validates and serializes its return
value on a worker thread again (`fastapi.routing.serialize_response` for non-coroutine endpoints):
two hand-offs per request, each a wake-up of a thread that then waits for the GIL. In the
`py-spy --gil` profile of a loaded server (benchmarks/control_load.py, docs/benchmarks.md) waking
worker threads (`Condition.notify` under anyio's `run_sync`) was 15% of the samples. A route built
with this class is wrapped in a coroutine that runs the same function on a worker thread once; the
answer is then validated and serialized on the event loop, as for an `async def` route. Behaviour is
unchanged: the same function, the same thread pool (and its limit, `ApiConfig.worker_threads`), the
same request context (anyio copies the context variables), exceptions raised as before.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from fastapi.routing import APIRoute


def one_hop(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`endpoint` (a plain function) as a coroutine running it on a worker thread. FastAPI reads
    the parameters and their annotations through `__wrapped__` (`inspect.signature`, `unwrap`)."""

    @functools.wraps(endpoint)
    async def offloaded(*args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(functools.partial(endpoint, *args, **kwargs))

    return offloaded


class OneHopRoute(APIRoute):
    """An `APIRoute` whose plain-function endpoint runs in one worker-thread hop (module docstring)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        plain = not (
            inspect.iscoroutinefunction(endpoint)
            or inspect.isgeneratorfunction(endpoint)
            or inspect.isasyncgenfunction(endpoint)
        )
        super().__init__(path, one_hop(endpoint) if plain else endpoint, **kwargs)
