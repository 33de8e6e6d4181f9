"""The log side of c2sp.org/tlog-witness: collect witness cosignatures on a signed checkpoint.

`request_cosignatures` submits the checkpoint to every witness (in parallel, standard library HTTP),
each with a consistency proof from the size that witness last cosigned, and returns the checkpoint
with every valid cosignature appended to its signature block plus one outcome per witness. One
witness being down, slow or refusing never raises: it is an `error` or `conflict` outcome, and the
caller decides how many cosignatures it needs (`kvguard.audit.cosign.require_cosignatures`).

Per witness (tlog-witness, "add-checkpoint"): send `old <size>` with the size last known for it
(`known_sizes`, default 0); on "409 Conflict" read the witness's size from the `text/x.tlog.size`
body and retry once with a proof from that size; on "200" keep only response lines that verify with
the witness's verifier key ("The client MUST ignore any cosignatures from unknown keys").
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

from kvguard.audit import note
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.cosign import WitnessVerifier, parse_witness_verifier_key, verify_cosignature
from kvguard.errors import KvguardError, VerificationError

ConsistencyProof = Callable[[int, int], list[bytes]]

_MAX_RESPONSE_BYTES = 64 * 1024
# A witness's whole exchange (a 409 and its retry included) ends within this many `timeout`s.
_DEADLINE_TIMEOUTS = 3
_SIZE_BODY = re.compile(r"(0|[1-9][0-9]{0,18})\n")


class Status(StrEnum):
    OK = "ok"  # the witness cosigned
    CONFLICT = "conflict"  # its view of the log differs from this checkpoint (409 unresolved, 422)
    ERROR = "error"  # unreachable, refused for another reason, or answered nonsense


@dataclass(frozen=True)
class WitnessEndpoint:
    """A witness: its submission prefix URL (http or https) and its verifier key (type 0x04)."""

    url: str
    verifier_key: str
    verifier: WitnessVerifier = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            raise ValueError(
                f"witness URL must be http(s)://host[:port][/prefix], not {self.url!r}"
            )
        object.__setattr__(self, "verifier", parse_witness_verifier_key(self.verifier_key))

    @property
    def name(self) -> str:
        return self.verifier.name

    @classmethod
    def parse(cls, text: str) -> WitnessEndpoint:
        """`URL=VKEY` (a command-line option): split at the first `=` (a URL here holds none;
        a verifier key's base64 may end in one)."""
        url, sep, vkey = text.partition("=")
        if not sep or not url or not vkey:
            raise ValueError(f"a witness is URL=VERIFIER_KEY, not {text!r}")
        return cls(url, vkey)


@dataclass(frozen=True)
class WitnessOutcome:
    status: Status
    reason: str = ""  # short, for logs and operators; never key material
    size: int | None = None  # the size this witness now holds for the log, when known
    cosignature: str | None = None  # the verified signature line, when status is ok


@dataclass(frozen=True)
class CosignOutcome:
    note: str  # the checkpoint with the valid cosignatures added to its signature block
    witnesses: dict[str, WitnessOutcome]  # by witness name

    @property
    def cosigned(self) -> list[str]:
        return sorted(n for n, o in self.witnesses.items() if o.status is Status.OK)

    def known_sizes(self) -> dict[str, int]:
        """The per-witness sizes to pass as `known_sizes` next time."""
        return {n: o.size for n, o in self.witnesses.items() if o.size is not None}


def request_cosignatures(
    endpoints: Sequence[WitnessEndpoint],
    signed_note: str,
    consistency_proof: ConsistencyProof,
    known_sizes: Mapping[str, int] | None = None,
    timeout: float = 5.0,
) -> CosignOutcome:
    """Ask every witness in `endpoints` to cosign `signed_note` (see the module docstring).

    `consistency_proof(old, new)` is the log's RFC 9162 proof, e.g. `Ledger.consistency_proof`;
    `known_sizes` maps witness names to the size each last cosigned (from `known_sizes()`).
    """
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise ValueError("two witness endpoints have the same witness name")
    text, sigs = note.split_note(signed_note)
    job = _Submission(signed_note, text, parse_checkpoint(text).size, consistency_proof, timeout)
    sizes = dict(known_sizes or {})
    outcomes = _within(
        _DEADLINE_TIMEOUTS * timeout,
        {e.name: functools.partial(job.submit, e, sizes.get(e.name, 0)) for e in endpoints},
    )
    fresh = {(e.name, e.verifier.key_id) for e in endpoints if outcomes[e.name].cosignature}
    lines = [note.signature_line(n, r[:4], r[4:]) for n, r in sigs if (n, r[:4]) not in fresh]
    lines += [o.cosignature for o in outcomes.values() if o.cosignature is not None]
    return CosignOutcome(note.join_note(text, lines), outcomes)


def _within(
    deadline_s: float, calls: dict[str, Callable[[], WitnessOutcome]]
) -> dict[str, WitnessOutcome]:
    """Run each call on a thread of its own; a call not done within `deadline_s` (from the start of
    all of them) is an `error` outcome. `timeout` bounds each socket operation only: a witness
    that sent its answer a byte at a time, just within it, held the checkpoint for as long as it
    liked (found by a review). A late call's thread is a daemon, left to end with its socket's
    timeout; its outcome is not used."""
    results: dict[str, WitnessOutcome] = {}
    opened: dict[str, list[http.client.HTTPConnection]] = {name: [] for name in calls}
    lock = threading.Lock()

    def run(name: str, call: Callable[[], WitnessOutcome]) -> None:
        _EXCHANGE.connections = opened[name]
        try:
            outcome = call()
        except Exception as exc:  # one witness's failure is its outcome, never the checkpoint's
            outcome = WitnessOutcome(Status.ERROR, f"failed: {type(exc).__name__}")
        with lock:
            results[name] = outcome

    threads = [
        threading.Thread(target=run, args=item, name=f"kvguard-witness-{n}", daemon=True)
        for n, item in enumerate(calls.items())
    ]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(max(end - time.monotonic(), 0.0))
    late = WitnessOutcome(Status.ERROR, f"no answer within {deadline_s:g} s")
    with lock:
        for thread, name in zip(threads, calls, strict=True):
            if name not in results:  # its outcome is `late`; its thread is made to end now
                reaper = threading.Thread(
                    target=_reap, args=(thread, opened[name]), name="kvguard-witness-reaper"
                )
                reaper.daemon = True
                reaper.start()
        return {name: results.get(name, late) for name in calls}


class _Answer(NamedTuple):
    status: int
    content_type: str
    body: bytes


@dataclass(frozen=True)
class _Submission:
    """One checkpoint being submitted to several witnesses."""

    signed_note: str
    text: str
    size: int
    consistency_proof: ConsistencyProof
    timeout: float

    def submit(self, endpoint: WitnessEndpoint, old: int) -> WitnessOutcome:
        if not 0 <= old <= self.size:
            old = 0  # a stale or foreign hint: let the witness tell us its size (409)
        answer = self._attempt(endpoint, old)
        if isinstance(answer, _Answer) and answer.status == 409:  # retry once from its size
            held = _parse_size(answer)
            if held is None:
                return WitnessOutcome(Status.ERROR, "409 without a valid text/x.tlog.size body")
            if held > self.size:
                reason = f"witness holds size {held}, beyond this checkpoint"
                return WitnessOutcome(Status.CONFLICT, reason, held)
            answer = self._attempt(endpoint, held)
        if isinstance(answer, WitnessOutcome):
            return answer
        if answer.status == 200:
            return _accept(endpoint, self.text, self.size, answer.body)
        reason = f"HTTP {answer.status}: {answer.body[:200].decode('utf-8', 'replace').strip()}"
        status = Status.CONFLICT if answer.status in {409, 422} else Status.ERROR
        return WitnessOutcome(status, reason)

    def _attempt(self, endpoint: WitnessEndpoint, old: int) -> _Answer | WitnessOutcome:
        try:
            proof = self.consistency_proof(old, self.size) if 0 < old < self.size else []
        except (KvguardError, ValueError) as exc:
            return WitnessOutcome(Status.ERROR, f"no consistency proof from size {old}: {exc}")
        lines = [f"old {old}", *(base64.b64encode(h).decode() for h in proof)]
        body = ("\n".join(lines) + "\n\n" + self.signed_note).encode()
        try:
            return _post(endpoint, body, self.timeout)
        except OSError as exc:  # URLError, timeouts, refused connections, oversized answers
            return WitnessOutcome(Status.ERROR, f"unreachable: {_describe(exc)}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A witness answers directly: a redirect would resend the checkpoint somewhere unconfigured."""

    def redirect_request(self, *_args: object, **_kwargs: object) -> None:
        return None


# The connections each witness exchange opens, by thread: `_within` shuts down the sockets of an
# exchange past its deadline, so its thread ends at once instead of reading on for as long as the
# witness drips bytes (each read is bounded by `timeout` only; found by a re-test: a thread and a
# socket left behind per checkpoint).
_EXCHANGE = threading.local()


def _tracked(connection_class: type[http.client.HTTPConnection]) -> Any:
    def make(host: str, **kwargs: Any) -> http.client.HTTPConnection:
        connection = connection_class(host, **kwargs)
        opened = getattr(_EXCHANGE, "connections", None)
        if opened is not None:
            opened.append(connection)
        return connection

    return make


class _TrackedHTTP(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_tracked(http.client.HTTPConnection), req)


class _HandshakeAfterConnect(http.client.HTTPSConnection):
    """`HTTPSConnection` with its TLS handshake run once `sock` is the TLS socket: the standard one
    shakes hands inside `wrap_socket`, while `sock` is the plain socket that wrapping detaches, so
    a reaper could not end a witness that never answers the handshake (found by a re-test)."""

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        hostname = getattr(self, "_tunnel_host", None) or self.host
        context = self._context  # type: ignore[attr-defined]
        self.sock = context.wrap_socket(
            self.sock, server_hostname=hostname, do_handshake_on_connect=False
        )
        self.sock.do_handshake()


class _TrackedHTTPS(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_tracked(_HandshakeAfterConnect), req, context=self._context)  # type: ignore[attr-defined]


_OPENER = urllib.request.build_opener(_NoRedirect, _TrackedHTTP, _TrackedHTTPS)


def _reap(thread: threading.Thread, connections: list[http.client.HTTPConnection]) -> None:
    """Shut down the sockets of a late exchange until its thread ends: its read fails at once,
    and a connection it opens after the deadline (a 409's retry) is shut as soon as it exists."""
    while thread.is_alive():
        for connection in list(connections):
            sock = connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        thread.join(0.05)


def _post(endpoint: WitnessEndpoint, body: bytes, timeout: float) -> _Answer:
    url = endpoint.url.rstrip("/") + "/add-checkpoint"
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked to be http(s)
        url, data=body, method="POST", headers={"Content-Type": "text/plain; charset=utf-8"}
    )
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return _Answer(response.status, response.headers.get_content_type(), _read(response))
    except urllib.error.HTTPError as exc:
        with exc:
            return _Answer(exc.code, exc.headers.get_content_type(), _read(exc))


class _Readable(Protocol):
    def read(self, amt: int, /) -> bytes: ...


def _read(response: _Readable) -> bytes:
    data = response.read(_MAX_RESPONSE_BYTES + 1)
    if len(data) > _MAX_RESPONSE_BYTES:
        raise OSError("witness response is too large")
    return data


def _parse_size(answer: _Answer) -> int | None:
    match = _SIZE_BODY.fullmatch(answer.body.decode("ascii", "replace"))
    if answer.content_type != "text/x.tlog.size" or match is None:
        return None
    return int(match.group(1))


def _accept(endpoint: WitnessEndpoint, text: str, size: int, answer: bytes) -> WitnessOutcome:
    """Keep the response line by this witness's key, after verifying it (others are ignored)."""
    v = endpoint.verifier
    try:
        _, sigs = note.split_note(text + "\n" + answer.decode("utf-8"))
        mine = [raw for name, raw in sigs if (name, raw[:4]) == (v.name, v.key_id)]
        if len(mine) != 1:
            return WitnessOutcome(
                Status.ERROR, f"{len(mine)} cosignatures by its key in the answer"
            )
        timestamp = verify_cosignature(text, mine[0], v)
    except (VerificationError, UnicodeDecodeError) as exc:
        return WitnessOutcome(Status.ERROR, f"bad cosignature: {exc}")
    line = note.signature_line(v.name, mine[0][:4], mine[0][4:])
    return WitnessOutcome(Status.OK, f"cosigned at {timestamp}", size, line)


def _describe(exc: OSError) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason if reason is not None else exc) or type(exc).__name__
