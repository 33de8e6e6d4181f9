"""A transparency-log witness (c2sp.org/tlog-witness) for kvguard ledgers, and its HTTP server.

A witness remembers, per log origin, the latest checkpoint it cosigned, and cosigns a new checkpoint
only if it is signed by a key configured for that origin and provably extends (RFC 6962 / RFC 9162
consistency proof) what it saw before. A log that shows one history to some auditors and another to
others (a fork, a rewritten ledger re-signed with a stolen or abused key) can therefore collect
cosignatures for only one of them: relying parties that demand cosignatures from enough witnesses
(`kvguard.audit.cosign.require_cosignatures`) see a single history.

Ownership: `kvguard.audit.witness_state.WitnessState` owns the state file (SQLite, 0600); `Witness`
owns the decision (pure logic over request bytes and the stored state, testable without HTTP);
`make_server` / `serve` only move bytes. The log-side client lives in
`kvguard.audit.witness_client` (re-exported here).

Statuses follow tlog-witness, "add-checkpoint": 400 malformed request or old size above the
checkpoint size, 403 no valid signature by a key trusted for the origin, 404 unknown origin, 409 old
size is not the size the witness last cosigned (body: that size, `text/x.tlog.size`), 422 a size-0
checkpoint with a non-empty-tree root, a proof with old size 0, or a consistency proof (or equal-size
root) that does not match. Refused checkpoints that are validly signed but inconsistent are kept as
evidence of log misbehaviour ("the witness MAY log the request") and never cosigned.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final, NamedTuple

from kvguard.audit import merkle, note
from kvguard.audit.checkpoint import Checkpoint, b64decode_strict, parse_checkpoint
from kvguard.audit.cosign import WitnessKey
from kvguard.audit.witness_client import (
    CosignOutcome,
    WitnessEndpoint,
    WitnessOutcome,
    request_cosignatures,
)
from kvguard.audit.witness_state import LogSlot, LogState, Refusal, WitnessState
from kvguard.errors import AuditError, VerificationError
from kvguard.logging import get_logger

__all__ = [
    "MAX_PROOF_HASHES",
    "MAX_REQUEST_BYTES",
    "SIZE_CONTENT_TYPE",
    "AddCheckpointRequest",
    "CosignOutcome",
    "LogState",
    "Refusal",
    "Witness",
    "WitnessEndpoint",
    "WitnessOutcome",
    "WitnessResponse",
    "WitnessState",
    "make_server",
    "parse_add_checkpoint",
    "request_cosignatures",
    "serve",
]

_log = get_logger("kvguard.audit.witness")

MAX_REQUEST_BYTES = 64 * 1024  # a checkpoint, 63 proof lines and a few signatures fit in 16 KiB
# tlog-witness: "The client MUST NOT send more than 63 consistency proof lines".
MAX_PROOF_HASHES = 63
# Connections served at once, and how long one may stay open whatever it sends: idle or dripping
# clients each held a thread for as long as they kept sending within the 30 s silence limit (300
# idle connections made 171 threads, found by a review). A log sends one request per connection.
MAX_CONNECTIONS: Final = 64
CONNECTION_DEADLINE_S: Final = 60.0
_BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
    b"Connection: close\r\n\r\n"
)
SIZE_CONTENT_TYPE = "text/x.tlog.size"
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"
_DECIMAL = re.compile(r"(0|[1-9][0-9]{0,18})")


class WitnessResponse(NamedTuple):
    status: int
    body: bytes
    content_type: str


class _RefusedError(Exception):
    """A refusal with its HTTP status; `reason` is the one-line response body."""

    def __init__(self, status: int, reason: str, content_type: str = TEXT_CONTENT_TYPE) -> None:
        super().__init__(reason)
        self.status, self.reason, self.content_type = status, reason, content_type

    def response(self) -> WitnessResponse:
        return WitnessResponse(self.status, f"{self.reason}\n".encode(), self.content_type)


class AddCheckpointRequest(NamedTuple):
    old_size: int
    proof: list[bytes]
    signed_note: str
    checkpoint: Checkpoint


MAX_TREE_SIZE: Final = (1 << 63) - 1


def parse_add_checkpoint(body: bytes) -> AddCheckpointRequest:
    """Parse an add-checkpoint request body (tlog-witness); raises VerificationError if malformed."""
    if len(body) > MAX_REQUEST_BYTES:
        raise VerificationError("request body is too large")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise VerificationError("request body is not UTF-8") from None
    head, sep, signed = text.partition("\n\n")
    lines = head.split("\n")
    if not sep or not lines[0].startswith("old ") or not _DECIMAL.fullmatch(lines[0][4:]):
        raise VerificationError("request must start with an `old <size>` line and a blank line")
    if len(lines) - 1 > MAX_PROOF_HASHES:
        raise VerificationError(f"more than {MAX_PROOF_HASHES} consistency proof lines")
    proof = [b64decode_strict(line, "consistency proof line") for line in lines[1:]]
    if any(len(h) != merkle.HASH_SIZE for h in proof):
        raise VerificationError("a consistency proof line is not a SHA-256 hash")
    checkpoint = parse_checkpoint(note.split_note(signed)[0])
    old_size = int(lines[0][4:])  # at most 19 digits (`_DECIMAL`)
    if checkpoint.size > MAX_TREE_SIZE or old_size > MAX_TREE_SIZE:
        # uint64 in C2SP, a signed 64-bit integer in the witness's state (SQLite): a size past it
        # was a 500 (found by a review); no log grows that large.
        raise VerificationError(f"tree sizes above {MAX_TREE_SIZE} are not witnessed")
    return AddCheckpointRequest(old_size, proof, signed, checkpoint)


def _check_consistency(
    old_size: int, proof: Sequence[bytes], new: Checkpoint, current: LogState | None
) -> None:
    """The tlog-witness consistency checks, in its order; raises `_RefusedError` (409 or 422)."""
    latest = current.size if current is not None else 0
    if old_size != latest:
        raise _RefusedError(409, str(latest), SIZE_CONTENT_TYPE)  # body: the size, then a newline
    if new.size == 0 and new.root != merkle.EMPTY_ROOT:
        raise _RefusedError(422, "a checkpoint of size 0 must have the empty tree's root")
    if old_size == 0:
        if proof:
            raise _RefusedError(422, "old size 0 needs an empty consistency proof")
        return
    assert current is not None  # old_size == latest > 0
    if new.size == old_size and not hmac.compare_digest(new.root, current.root):
        raise _RefusedError(422, f"fork: a different root for the cosigned size {old_size}")
    try:
        merkle.verify_consistency(old_size, new.size, current.root, new.root, proof)
    except VerificationError as exc:
        raise _RefusedError(422, f"consistency proof from size {old_size} failed: {exc}") from None


class Witness:
    """The add-checkpoint decision: verify, check consistency, persist, cosign."""

    def __init__(
        self,
        key: WitnessKey,
        logs: Mapping[str, Sequence[note.Verifier]],
        state: WitnessState,
    ) -> None:
        if not logs or not all(logs.values()):
            raise AuditError("a witness needs at least one log, each with a verifier key")
        self.key = key
        self._logs = {origin: list(keys) for origin, keys in logs.items()}
        self._by_hash = {hashlib.sha256(o.encode()).hexdigest(): o for o in self._logs}
        self.state = state

    def add_checkpoint(self, body: bytes, now: int) -> WitnessResponse:
        """Answer one add-checkpoint request at time `now` (POSIX seconds)."""
        try:
            return self._add(body, now)
        except _RefusedError as refused:
            return refused.response()

    def _add(self, body: bytes, now: int) -> WitnessResponse:
        try:
            req = parse_add_checkpoint(body)
        except VerificationError as exc:
            raise _RefusedError(400, f"malformed request: {exc}") from None
        cp = req.checkpoint
        verifiers = self._logs.get(cp.origin)
        if verifiers is None:
            raise _RefusedError(404, "unknown log origin")
        try:
            text, _ = note.open_note(req.signed_note, verifiers)
        except VerificationError as exc:
            raise _RefusedError(403, f"checkpoint signature: {exc}") from None
        if req.old_size > cp.size:
            raise _RefusedError(400, "old size is larger than the checkpoint size")
        refused: _RefusedError | None = None
        with self.state.transaction(cp.origin) as slot:  # check and persist atomically
            try:
                _check_consistency(req.old_size, req.proof, cp, slot.current)
            except _RefusedError as exc:
                refused = exc
                if exc.status == 422:  # validly signed yet inconsistent: keep it as evidence
                    self._keep_evidence(slot, req, exc.reason, now)
            else:
                line = self.key.cosignature_line(text, now)
                slot.store(LogState(cp.size, cp.root, _with_line(req.signed_note, line), now))
        if refused is not None:
            raise refused
        _log.info("witness cosigned", origin=cp.origin, old_size=req.old_size, size=cp.size)
        return WitnessResponse(200, line.encode(), TEXT_CONTENT_TYPE)

    def _keep_evidence(
        self, slot: LogSlot, req: AddCheckpointRequest, reason: str, now: int
    ) -> None:
        _log.warning(
            "witness refused an inconsistent checkpoint (possible log fork)",
            origin=req.checkpoint.origin,
            old_size=req.old_size,
            size=req.checkpoint.size,
            reason=reason,
        )
        slot.keep_evidence(Refusal(now, req.old_size, reason, req.signed_note))

    def latest_checkpoint(self, origin_hash: str) -> str | None:
        """tlog-witness "Monitor Retrieval": the latest cosigned checkpoint of the origin whose
        lowercase hex SHA-256 is `origin_hash`, with the log's and this witness's signatures."""
        origin = self._by_hash.get(origin_hash)
        state = self.state.latest(origin) if origin is not None else None
        return state.note if state is not None else None


def _with_line(signed_note: str, line: str) -> str:
    """`signed_note` with `line` in its signature block (replacing an older line by this key)."""
    text, sigs = note.split_note(signed_note)
    (new,) = note.split_note(text + "\n" + line)[1]
    kept = [(n, raw) for n, raw in sigs if (n, raw[:4]) != (new[0], new[1][:4])]
    return note.join_note(text, [note.signature_line(n, r[:4], r[4:]) for n, r in kept] + [line])


# -- HTTP ------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        witness: Witness,
        clock: Callable[[], float],
        *,
        max_connections: int = MAX_CONNECTIONS,
        connection_deadline_s: float = CONNECTION_DEADLINE_S,
    ) -> None:
        super().__init__(address, _Handler)
        self.witness, self.clock = witness, clock
        self.connection_deadline_s = connection_deadline_s
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, up to `max_connections`; past that a 503 at once."""
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive (tlog-witness, "HTTP Interface": SHOULD)
    timeout = 30  # seconds of silence before a connection is dropped (slow-client guard)
    server_version = "kvguard-witness"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # Past the deadline the socket is shut down: a read or write in progress ends at once.
        self._deadline = threading.Timer(self.server.connection_deadline_s, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._deadline.cancel()
        with contextlib.suppress(OSError):  # a connection the deadline shut down
            super().finish()

    def do_POST(self) -> None:
        if self.path != "/add-checkpoint":
            return self._send(WitnessResponse(404, b"not found\n", TEXT_CONTENT_TYPE))
        raw_length = self.headers.get("Content-Length")
        if raw_length is None or not (raw_length.isascii() and raw_length.isdigit()):
            self.close_connection = True
            return self._send(WitnessResponse(411, b"Content-Length required\n", TEXT_CONTENT_TYPE))
        # Length first: int() refuses more than 4,300 digits with a ValueError (a dropped
        # connection and a traceback, found by a review), and no body this size is accepted.
        if len(raw_length) > len(str(MAX_REQUEST_BYTES)) or int(raw_length) > MAX_REQUEST_BYTES:
            self.close_connection = True  # the unread body must not be parsed as a next request
            return self._send(WitnessResponse(413, b"request too large\n", TEXT_CONTENT_TYPE))
        body = self.rfile.read(int(raw_length))
        try:
            response = self.server.witness.add_checkpoint(body, int(self.server.clock()))
        except Exception:  # answer 500, never a traceback to the client
            _log.exception("witness add-checkpoint failed")
            response = WitnessResponse(500, b"internal error\n", TEXT_CONTENT_TYPE)
        self._send(response)

    def do_GET(self) -> None:
        parts = self.path.split("/")
        if self.path == "/add-checkpoint":
            return self._send(WitnessResponse(405, b"use POST\n", TEXT_CONTENT_TYPE), allow="POST")
        found = None
        if len(parts) == 3 and parts[0] == "" and parts[2] == "checkpoint":
            found = self.server.witness.latest_checkpoint(parts[1])
        if found is None:
            return self._send(WitnessResponse(404, b"not found\n", TEXT_CONTENT_TYPE))
        self._send(WitnessResponse(200, found.encode(), TEXT_CONTENT_TYPE))

    def _send(self, response: WitnessResponse, allow: str | None = None) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        if allow is not None:
            self.send_header("Allow", allow)
        self.end_headers()
        self.wfile.write(response.body)

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("witness http", line=format % args)


def make_server(
    witness: Witness,
    host: str,
    port: int,
    *,
    clock: Callable[[], float] = time.time,
    max_connections: int = MAX_CONNECTIONS,
    connection_deadline_s: float = CONNECTION_DEADLINE_S,
) -> ThreadingHTTPServer:
    """An HTTP server answering `POST /add-checkpoint` (and monitor `GET /<hash>/checkpoint`):
    at most `max_connections` at once (a 503 past them), each closed after
    `connection_deadline_s` whatever it is doing."""
    return _Server(
        (host, port),
        witness,
        clock,
        max_connections=max_connections,
        connection_deadline_s=connection_deadline_s,
    )


def serve(
    witness: Witness,
    host: str,
    port: int,
    *,
    on_listening: Callable[[str, int], None] | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Serve until interrupted; `on_listening(host, port)` is called once the socket is bound."""
    server = make_server(witness, host, port, clock=clock)
    try:
        if on_listening is not None:
            bound = server.server_address
            on_listening(str(bound[0]), int(bound[1]))
        server.serve_forever()
    finally:
        server.server_close()
