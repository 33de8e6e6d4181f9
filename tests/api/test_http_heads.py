"""Request heads (request line and headers) are bounded in size and time by `kvguard serve`.

Found by a review: uvicorn kept appending a header a client never ended (256 MiB took the server
from 113 to 422 MiB and stalled other requests for seconds), and connections that never finished
their headers were never closed, until the process ran out of file descriptors and valid keys were
refused. `kvguard.api.http_protocol`: 431 past 64 KiB, 408 past 10 s; everything else as before.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from kvguard.api.http_protocol import HEAD_TIMEOUT_S, MAX_HEAD_BYTES
from kvguard.control.keys import ApiKeys, Role
from tests.api.test_crash_consistency import Api

pytestmark = pytest.mark.slow


def _read_all(conn: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (or `timeout` passes)."""
    conn.settimeout(timeout)
    out = b""
    try:
        while chunk := conn.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_request_heads_are_bounded_in_size_and_time(tmp_path: Path, workers: int) -> None:
    db_url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    engine = sa.create_engine(db_url)
    key = ApiKeys(engine).create(Role.ADMIN).api_key
    engine.dispose()
    api = Api(db_url, tmp_path)
    api.extra_args = ["--workers", str(workers)]
    api.start()
    try:
        address = ("127.0.0.1", api.port)
        # A header that never ends: refused once past the bound, long before it is all sent.
        with socket.create_connection(address, timeout=10) as big:
            big.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: ")
            sent = 0
            try:
                while sent < 8 * MAX_HEAD_BYTES:
                    big.sendall(b"a" * 4096)
                    sent += 4096
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = _read_all(big, 5)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:100]

        # Heads that never complete (half a header; nothing at all) are closed in time.
        slow = socket.create_connection(address, timeout=10)
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        silent = socket.create_connection(address, timeout=10)
        started = time.monotonic()
        answers = [_read_all(slow, HEAD_TIMEOUT_S + 10), _read_all(silent, HEAD_TIMEOUT_S + 10)]
        assert time.monotonic() - started < HEAD_TIMEOUT_S + 8
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
        slow.close()
        silent.close()

        # A pipelined request's body is no head (a re-test found a 200 KB body behind a GET on the
        # same connection refused with 431 once the GET's response was sent).
        body = b'{"tenant_id": "big", "display_name": "' + b"x" * 200_000 + b'"}'
        get = f"GET /v1/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
        post = (
            f"POST /v1/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with socket.create_connection(address, timeout=30) as pipelined:
            pipelined.sendall(get.encode() + post.encode())
            time.sleep(0.3)  # the GET is answered while the POST's body is still to come
            for i in range(0, len(body), 16384):
                pipelined.sendall(body[i : i + 16384])
                time.sleep(0.005)
            answers = _read_all(pipelined, 3)
        assert answers.count(b"HTTP/1.1 ") == 2 and b" 431 " not in answers, answers[:300]

        # Ordinary requests, a large body and keep-alive included, are served as before.
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=api.url, headers=auth, timeout=20) as client:
            assert client.get("/v1/tenants").status_code == 200
            body = {"tenant_id": "acme", "display_name": "x" * 100_000}
            assert client.post("/v1/tenants", json=body).status_code in (201, 422)
            time.sleep(1)
            assert client.get("/v1/tenants").status_code == 200  # the same connection, reused
    finally:
        api.stop()
