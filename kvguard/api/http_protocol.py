"""Bounds on what a client sends before its request's body reaches the application.

uvicorn bounds neither the request line and headers (its httptools protocol keeps appending them)
nor how long a connection may take to send them (its keep-alive timer stops at the first byte, and
no timer runs before the first request). Found by a review of `kvguard serve`: one connection
without a key streaming a 256 MiB header took the server from 113 to 422 MiB and stalled every
other request for seconds (the parser's cost lands on the event loop), and connections that never
finish their headers stayed open for good, until the process ran out of file descriptors and
valid keys were refused. The body limit and "authenticated before the body is read"
(`kvguard.api.limits`) never came into play: both run once the headers are complete.

`BoundedHttpToolsProtocol` closes a connection whose request head (request line and headers)
passes `MAX_HEAD_BYTES` (answered `431`) or is not complete `HEAD_TIMEOUT_S` after the connection
opened or the previous response ended (answered `408`). Without httptools, uvicorn's h11 protocol
is used with its own head size bound (`h11_max_incomplete_event_size`), and no head timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

MAX_HEAD_BYTES: Final = 64 * 1024  # a request line and headers; a browser's are a few KiB
HEAD_TIMEOUT_S: Final = 10.0

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    HAVE_HTTPTOOLS = True
except ImportError:  # uvicorn without httptools: h11 only
    HAVE_HTTPTOOLS = False


def http_options() -> dict[str, Any]:
    """The uvicorn settings that bound request heads (`kvguard serve`)."""
    if not HAVE_HTTPTOOLS:
        return {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
    return {"http": BoundedHttpToolsProtocol}


if HAVE_HTTPTOOLS:

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a size and a time limit on each request head."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._in_body = False  # between a request's head and the end of its body
            self._head_started()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_done()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if (
                self._head_timer is not None
                and not self._in_body
                and not self.transport.is_closing()
            ):
                # Still in a head after the parser took `data` (a head that completed in it
                # stopped the count): the parser holds at most this much of it.
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(431, "request line and headers too large")

        def on_headers_complete(self) -> None:
            self._head_done()
            self._in_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()
            self._maybe_next_head()  # a response sent before the body ended (401, 413)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._maybe_next_head()

        def _maybe_next_head(self) -> None:
            """Time the next request's head once this request is over on both sides: its body
            read and its response sent, with no pipelined request already running (a re-test
            found a pipelined request's body counted as a head, and refused with 431)."""
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self._in_body and not self.pipeline and not self.transport.is_closing():
                self._head_started()

        def _head_started(self) -> None:
            self._head_done()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

        def _head_done(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            busy = self.cycle is not None and not self.cycle.response_complete
            if not busy and not self.transport.is_closing():
                self._refuse(408, "request headers not received in time")

        def _refuse(self, status: int, message: str) -> None:
            self._head_done()
            reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
            body = message.encode("ascii")
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, reason, len(body), body)
            )
            self.transport.close()
