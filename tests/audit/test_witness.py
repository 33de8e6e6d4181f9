"""Witness cosignatures (c2sp.org/tlog-cosignature) and the witness (c2sp.org/tlog-witness).

Three layers: the cosignature format against the spec's layout; `Witness.add_checkpoint` as pure
logic over real ledger checkpoints and proofs; and end to end, two `kvguard witness serve` processes
cosigning a real ledger, then refusing a fork made by rewriting the ledger's SQL behind its back.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from kvguard.audit import merkle, note
from kvguard.audit.checkpoint import Checkpoint, format_checkpoint
from kvguard.audit.cosign import (
    WitnessKey,
    cosignatures,
    parse_witness_verifier_key,
    require_cosignatures,
)
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.audit.witness import (
    SIZE_CONTENT_TYPE,
    Witness,
    WitnessEndpoint,
    WitnessState,
    make_server,
    request_cosignatures,
)
from kvguard.audit.witness_cli import LOG_OPTION_FORM
from kvguard.audit.witness_client import Status
from kvguard.cli import app
from kvguard.errors import ConfigError, SecretFileError, VerificationError

from .conftest import ORIGIN, make_event
from .witness_helpers import WitnessProcess, free_port, rewrite_history

NOW = 1_780_000_000
Opener = Callable[..., Ledger]

# c2sp.org/tlog-cosignature, "Format" and "Ed25519 signed message": the example checkpoint and the
# timestamp of its example message.
SPEC_CHECKPOINT = (
    "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
)
SPEC_TIME = 1679315147
SPEC_COSIG_BLOB = (
    "jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZCB9dlrDJsX3b2oyin1nPZqhf5nNo0xUe+"
    "mbIUBkBIfZ+qnA=="
)
# A deployed witness's verifier key (transparency-dev/formats, note_cosigv1_test.go): type 0x04.
REAL_WITNESS_VKEY = "remora.n621.de+da77ade7+BOvN63jn/bLvkieywe8R6UYAtVtNbZpXh34x7onlmtw2"
# RFC 8032 section 7.1, TEST 1 secret key: a fixed seed for a reproducible cosignature.
RFC8032_SEED = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")


def _body(old: int, proof: list[bytes], signed: str) -> bytes:
    lines = [f"old {old}", *(base64.b64encode(h).decode() for h in proof)]
    return ("\n".join(lines) + "\n\n" + signed).encode()


def _grow(ledger: Ledger, n: int) -> str:
    start = ledger.size
    ledger.append_many([make_event(start + i) for i in range(n)])
    return ledger.checkpoint()


@pytest.fixture
def wkey() -> WitnessKey:
    return WitnessKey.generate("witness.kvguard.test/w1")


@pytest.fixture
def witness(tmp_path: Path, wkey: WitnessKey, key: SigningKey) -> Iterator[Witness]:
    state = WitnessState(tmp_path / "witness.db")
    yield Witness(wkey, {ORIGIN: [key.verifier()]}, state)
    state.close()


# -- cosignature format --------------------------------------------------------------------------


def test_cosignature_layout_matches_the_spec_byte_for_byte() -> None:
    wk = WitnessKey("witness.example.com/w1", RFC8032_SEED)
    public = Ed25519PrivateKey.from_private_bytes(RFC8032_SEED).public_key()
    raw_public = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    assert wk.public_key == raw_public  # RFC 8032 TEST 1 public key
    expected_id = hashlib.sha256(b"witness.example.com/w1\n\x04" + raw_public).digest()[:4]
    assert wk.key_id == expected_id
    vkey = "witness.example.com/w1+" + expected_id.hex() + "+"
    assert wk.verifier_key() == vkey + base64.b64encode(b"\x04" + raw_public).decode()

    line = wk.cosignature_line(SPEC_CHECKPOINT, SPEC_TIME)
    assert line.startswith("\u2014 witness.example.com/w1 ") and line.endswith("\n")
    blob = base64.b64decode(line.split(" ")[2])
    assert len(blob) == 4 + 8 + 64
    assert blob[:4] == expected_id
    assert int.from_bytes(blob[4:12], "big") == SPEC_TIME
    message = b"cosignature/v1\ntime 1679315147\n" + SPEC_CHECKPOINT.encode()
    public.verify(blob[12:], message)  # raises if the signed message differs by one byte
    assert line == wk.cosignature_line(SPEC_CHECKPOINT, SPEC_TIME)  # Ed25519 is deterministic


def test_spec_example_cosignature_line_has_the_v1_framing() -> None:
    blob = base64.b64decode(SPEC_COSIG_BLOB)
    assert len(blob) == 76
    assert blob[:4].hex() == "8d66cf3f"
    assert int.from_bytes(blob[4:12], "big") == SPEC_TIME


def test_real_witness_verifier_key_parses_and_types_are_not_confused() -> None:
    verifier = parse_witness_verifier_key(REAL_WITNESS_VKEY)
    assert verifier.name == "remora.n621.de" and verifier.key_id.hex() == "da77ade7"
    with pytest.raises(VerificationError):
        note.parse_verifier_key(REAL_WITNESS_VKEY)  # a cosigning key is not a log key
    with pytest.raises(VerificationError):
        parse_witness_verifier_key(SigningKey.generate("log.example").verifier_key())
    with pytest.raises(VerificationError):
        parse_witness_verifier_key(REAL_WITNESS_VKEY.replace("da77ade7", "da77ade8"))


def test_witness_key_file_is_0600_round_trips_and_never_shows_the_seed(tmp_path: Path) -> None:
    wk = WitnessKey.generate("witness.kvguard.test/w1")
    path = wk.save(tmp_path / "w.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().startswith("PRIVATE+KEY+witness.kvguard.test/w1+")
    loaded = WitnessKey.load(path)
    assert loaded.verifier_key() == wk.verifier_key()
    assert wk.encode() not in repr(loaded) and "PRIVATE" not in repr(loaded)
    with pytest.raises(SecretFileError):
        wk.save(path)
    path.chmod(0o644)
    with pytest.raises(SecretFileError):
        WitnessKey.load(path)
    with pytest.raises(ConfigError):
        WitnessKey.decode(SigningKey.generate("log.example").encode())  # type 0x01, not 0x04


def test_cosignatures_sit_beside_the_log_signature(key: SigningKey) -> None:
    text = format_checkpoint(Checkpoint(ORIGIN, 3, merkle.leaf_hash(b"x")))
    w1, w2, w3 = (WitnessKey.generate(f"w{i}.kvguard.test") for i in (1, 2, 3))
    stranger = WitnessKey.generate("stranger.kvguard.test")
    lines = [key.signature_line(text)]
    lines += [w.cosignature_line(text, NOW + i) for i, w in enumerate((w1, w2, stranger))]
    signed = note.join_note(text, lines)

    assert note.open_note(signed, [key.verifier()])[0] == text  # cosignatures are ignored there
    found = cosignatures(signed, [w1.verifier(), w2.verifier(), w3.verifier()])
    assert [(c.name, c.timestamp) for c in found] == [
        ("w1.kvguard.test", NOW),
        ("w2.kvguard.test", NOW + 1),
    ]
    vkeys = [w.verifier_key() for w in (w1, w2, w3)]
    assert require_cosignatures(signed, vkeys, 2) == ["w1.kvguard.test", "w2.kvguard.test"]
    with pytest.raises(VerificationError, match="only 2 of the 3 required witness cosignatures"):
        require_cosignatures(signed, vkeys, 3)


def test_a_bad_cosignature_by_a_trusted_witness_fails_closed(key: SigningKey) -> None:
    text = format_checkpoint(Checkpoint(ORIGIN, 3, merkle.leaf_hash(b"x")))
    other = format_checkpoint(Checkpoint(ORIGIN, 3, merkle.leaf_hash(b"y")))
    w1 = WitnessKey.generate("w1.kvguard.test")
    moved = note.join_note(text, [key.signature_line(text), w1.cosignature_line(other, NOW)])
    with pytest.raises(VerificationError, match="does not verify"):
        cosignatures(moved, [w1.verifier()])
    with pytest.raises(VerificationError):
        require_cosignatures(moved, [w1.verifier_key()], 1)


def test_one_witness_counts_once_and_shared_keys_are_refused() -> None:
    text = format_checkpoint(Checkpoint(ORIGIN, 1, merkle.leaf_hash(b"x")))
    old, new = WitnessKey.generate("w1.kvguard.test"), WitnessKey.generate("w1.kvguard.test")
    signed = note.join_note(
        text, [old.cosignature_line(text, NOW), new.cosignature_line(text, NOW)]
    )
    rotation = [old.verifier_key(), new.verifier_key()]
    with pytest.raises(ConfigError, match="cannot require 2"):
        require_cosignatures(signed, rotation, 2)  # one witness under two keys is one witness
    assert require_cosignatures(signed, rotation, 1) == ["w1.kvguard.test"]
    twin = WitnessKey("w2.kvguard.test", RFC8032_SEED)
    same = WitnessKey("w3.kvguard.test", RFC8032_SEED)
    # The Ed25519 message does not commit to the name: one key under two names is refused.
    with pytest.raises(ConfigError, match="share a public key"):
        require_cosignatures(signed, [twin.verifier_key(), same.verifier_key()], 1)


def test_cosign_module_imports_only_cryptography_and_stdlib() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import kvguard.audit.cosign\n"
        "mods = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(' '.join(sorted(m for m in mods if m not in sys.stdlib_module_names)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(out.stdout.split()) <= {"kvguard", "cryptography", "_openssl", "_cffi_backend"}


# -- Witness.add_checkpoint (pure logic, no HTTP) ------------------------------------------------


def test_first_checkpoint_then_growth_with_a_valid_proof(
    witness: Witness, open_ledger: Opener, sqlite_url: str, wkey: WitnessKey
) -> None:
    ledger = open_ledger(sqlite_url)
    first = _grow(ledger, 5)
    status, body, _ = witness.add_checkpoint(_body(0, [], first), NOW)
    assert status == 200
    cosigned = note.join_note(*_with(first, body.decode()))
    assert cosignatures(cosigned, [wkey.verifier()])[0].timestamp == NOW

    second = _grow(ledger, 6)
    response = witness.add_checkpoint(_body(5, ledger.consistency_proof(5, 11), second), NOW + 1)
    assert response.status == 200
    state = witness.state.latest(ORIGIN)
    assert state is not None and (state.size, state.root) == (11, ledger.root(11))
    assert require_cosignatures(state.note, [wkey.verifier_key()], 1)
    assert witness.add_checkpoint(_body(11, [], second), NOW + 2).status == 200  # same tree again


def _with(signed: str, response: str) -> tuple[str, list[str]]:
    text, sigs = note.split_note(signed)
    lines = [note.signature_line(n, r[:4], r[4:]) for n, r in sigs]
    return text, [*lines, response]


def test_stale_old_size_gets_409_with_the_witness_size(
    witness: Witness, open_ledger: Opener, sqlite_url: str
) -> None:
    ledger = open_ledger(sqlite_url)
    assert witness.add_checkpoint(_body(0, [], _grow(ledger, 4)), NOW).status == 200
    signed = _grow(ledger, 4)
    for stale in (0, 3):
        proof = ledger.consistency_proof(stale, 8) if stale else []
        assert witness.add_checkpoint(_body(stale, proof, signed), NOW) == (
            409,
            b"4\n",
            SIZE_CONTENT_TYPE,
        )
    assert witness.add_checkpoint(_body(9, [], signed), NOW).status == 400  # old > size


def test_a_bad_proof_is_refused_and_kept_as_evidence(
    witness: Witness, open_ledger: Opener, sqlite_url: str
) -> None:
    ledger = open_ledger(sqlite_url)
    witness.add_checkpoint(_body(0, [], _grow(ledger, 5)), NOW)
    before = witness.state.latest(ORIGIN)
    signed = _grow(ledger, 4)
    proof = ledger.consistency_proof(5, 9)
    bad = [proof[0][:-1] + bytes([proof[0][-1] ^ 1]), *proof[1:]]
    for wrong in (bad, proof[:-1], [*proof, proof[0]]):
        assert witness.add_checkpoint(_body(5, wrong, signed), NOW).status == 422
    assert witness.add_checkpoint(_body(0, proof, signed), NOW).status == 409  # stale first
    assert witness.state.latest(ORIGIN) == before
    assert len(witness.state.refusals(ORIGIN)) == 3


def test_a_fork_at_equal_size_is_refused(
    witness: Witness, open_ledger: Opener, tmp_path: Path
) -> None:
    honest = open_ledger(f"sqlite:///{tmp_path / 'a.db'}")
    forked = open_ledger(f"sqlite:///{tmp_path / 'b.db'}")  # same origin and key, other history
    witness.add_checkpoint(_body(0, [], _grow(honest, 6)), NOW)
    before = witness.state.latest(ORIGIN)
    forked.append(make_event(99))
    fork = _grow(forked, 5)
    status, body, _ = witness.add_checkpoint(_body(6, [], fork), NOW)
    assert (status, b"fork" in body) == (422, True)
    assert witness.state.latest(ORIGIN) == before
    assert [r.note for r in witness.state.refusals(ORIGIN)] == [fork]


def test_unknown_origin_bad_signature_and_malformed_requests(
    witness: Witness, open_ledger: Opener, sqlite_url: str, key: SigningKey
) -> None:
    good = _grow(open_ledger(sqlite_url), 3)
    text = note.split_note(good)[0]
    other_origin = format_checkpoint(Checkpoint("other.test/log", 3, merkle.leaf_hash(b"x")))
    assert (
        witness.add_checkpoint(
            _body(0, [], note.join_note(other_origin, [key.signature_line(other_origin)])), NOW
        ).status
        == 404
    )
    impostor = SigningKey.generate(key.name)  # same name, other key: an unknown key ID
    assert (
        witness.add_checkpoint(
            _body(0, [], note.join_note(text, [impostor.signature_line(text)])), NOW
        ).status
        == 403
    )
    line = key.signature_line(text)
    forged = line[:-6] + ("A" if line[-6] != "A" else "B") + line[-5:]
    assert witness.add_checkpoint(_body(0, [], note.join_note(text, [forged])), NOW).status == 403
    too_long = [merkle.leaf_hash(bytes([i])) for i in range(64)]
    for raw in (
        b"old 01\n\n" + good.encode(),
        b"old 0\n" + good.encode(),
        b"new 0\n\n" + good.encode(),
        b"old 0\nnot base64!\n\n" + good.encode(),
        _body(0, too_long, good),
        b"old 0\n\n" + good.encode() + b"x" * 70_000,
        b"old 0\n\n\xff" + good.encode(),
    ):
        assert witness.add_checkpoint(raw, NOW).status == 400, raw[:20]
    assert witness.state.latest(ORIGIN) is None


def test_size_zero_checkpoints_need_the_empty_root(witness: Witness, key: SigningKey) -> None:
    def signed(root: bytes) -> str:
        text = format_checkpoint(Checkpoint(ORIGIN, 0, root))
        return note.join_note(text, [key.signature_line(text)])

    assert witness.add_checkpoint(_body(0, [], signed(merkle.leaf_hash(b""))), NOW).status == 422
    assert witness.add_checkpoint(_body(0, [], signed(merkle.EMPTY_ROOT)), NOW).status == 200


def test_state_never_goes_backwards_and_survives_a_restart(
    tmp_path: Path, wkey: WitnessKey, key: SigningKey, open_ledger: Opener, sqlite_url: str
) -> None:
    path = tmp_path / "state" / "witness.db"
    state = WitnessState(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ledger = open_ledger(sqlite_url)
    small = _grow(ledger, 3)
    big = _grow(ledger, 7)
    witness = Witness(wkey, {ORIGIN: [key.verifier()]}, state)
    assert witness.add_checkpoint(_body(0, [], big), NOW).status == 200
    assert witness.add_checkpoint(_body(3, [], small), NOW).status == 409
    assert witness.add_checkpoint(_body(10, [], small), NOW).status == 400
    state.close()

    with sqlite3.connect(path) as raw, pytest.raises(sqlite3.IntegrityError, match="backwards"):
        raw.execute("UPDATE witness_logs SET size = 3")  # the triggers guard the file itself
    restarted = Witness(wkey, {ORIGIN: [key.verifier()]}, WitnessState(path))
    assert restarted.add_checkpoint(_body(0, [], small), NOW).body == b"10\n"
    latest = _grow(ledger, 2)
    proof = ledger.consistency_proof(10, 12)
    assert restarted.add_checkpoint(_body(10, proof, latest), NOW).status == 200
    restarted.state.close()
    assert {stat.S_IMODE(p.stat().st_mode) for p in path.parent.iterdir()} == {0o600}


def test_two_processes_on_one_state_file_cannot_both_advance_from_one_size(
    tmp_path: Path, wkey: WitnessKey, key: SigningKey, open_ledger: Opener, sqlite_url: str
) -> None:
    path = tmp_path / "witness.db"
    a, b = (Witness(wkey, {ORIGIN: [key.verifier()]}, WitnessState(path)) for _ in range(2))
    ledger = open_ledger(sqlite_url)
    a.add_checkpoint(_body(0, [], _grow(ledger, 4)), NOW)
    first, second = _grow(ledger, 2), _grow(ledger, 3)
    bodies = [
        (a, _body(4, ledger.consistency_proof(4, 6), first)),
        (b, _body(4, ledger.consistency_proof(4, 9), second)),
    ]
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda w=w, x=x: statuses.append(w.add_checkpoint(x, NOW).status))
        for w, x in bodies
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [200, 409]
    a.state.close()
    b.state.close()


# -- HTTP server and client (in process) ---------------------------------------------------------


@pytest.fixture
def served(witness: Witness) -> Iterator[str]:
    server = make_server(witness, "127.0.0.1", 0, clock=lambda: float(NOW))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_witness_caps_connections_and_their_lifetime(witness: Witness) -> None:
    """Idle or dripping clients each held a thread while they sent something every 29 s (300 idle
    connections made 171 threads, found by a review): past `max_connections` a connection gets a
    503 at once, and each is closed after `connection_deadline_s`, idle or not."""
    import socket  # noqa: PLC0415
    import time  # noqa: PLC0415

    server = make_server(
        witness, "127.0.0.1", 0, clock=lambda: float(NOW), max_connections=2,
        connection_deadline_s=1.0,
    )  # fmt: skip
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = server.server_address[:2]
    try:
        idle = [socket.create_connection(address, timeout=5) for _ in range(2)]
        time.sleep(0.2)  # both accepted and holding their threads
        with socket.create_connection(address, timeout=5) as third:
            assert third.recv(100).startswith(b"HTTP/1.1 503")
        started = time.monotonic()
        idle[0].sendall(b"POST /add-checkpoint HTTP/1.1\r\nContent-Length: 10")  # dripping
        for conn in idle:
            assert conn.recv(100) == b""  # closed by the server at its deadline
            conn.close()
        assert time.monotonic() - started < 3
        time.sleep(0.2)
        origin_hash = hashlib.sha256(ORIGIN.encode()).hexdigest()
        url = f"http://127.0.0.1:{address[1]}"
        assert _http(url, "GET", f"/{origin_hash}/checkpoint").status == 404  # slots came back
    finally:
        server.shutdown()
        server.server_close()


def _http(
    url: str, method: str, path: str, body: bytes = b"", **headers: str
) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def test_http_routes_and_limits(served: str, witness: Witness) -> None:
    assert _http(served, "GET", "/add-checkpoint").status == 405
    assert _http(served, "POST", "/checkpoint", b"x").status == 404
    big = _http(served, "POST", "/add-checkpoint", b"", **{"Content-Length": "70000"})
    assert big.status == 413
    assert _http(served, "POST", "/add-checkpoint", b"old 0\n\n").status == 400
    # A Content-Length past int()'s 4,300 digits dropped the connection with a traceback (a
    # review): too large, like any other.
    huge = _http(served, "POST", "/add-checkpoint", b"", **{"Content-Length": "9" * 5000})
    assert huge.status == 413
    origin_hash = hashlib.sha256(ORIGIN.encode()).hexdigest()
    assert _http(served, "GET", f"/{origin_hash}/checkpoint").status == 404


def test_a_size_past_a_signed_64_bit_integer_is_refused_not_a_500(
    served: str, key: SigningKey
) -> None:
    """C2SP sizes are uint64, the witness's state a signed 64-bit integer: a validly signed
    checkpoint of size 2^63 was a 500 (found by a review)."""
    for size in (1 << 63, (1 << 64) - 1):
        text = format_checkpoint(Checkpoint(ORIGIN, size, b"\x00" * 32))
        signed = note.join_note(text, [key.signature_line(text)])
        assert _http(served, "POST", "/add-checkpoint", _body(0, [], signed)).status == 400
        assert _http(served, "POST", "/add-checkpoint", _body(size, [], signed)).status == 400


def test_a_witness_dripping_its_answer_cannot_hold_the_checkpoint(
    served: str, wkey: WitnessKey, open_ledger: Opener, sqlite_url: str
) -> None:
    """`timeout` bounds each socket operation: a witness sending its answer a byte at a time,
    within it, held `checkpoint()` for as long as it liked (found by a review). Its whole exchange
    ends within a few timeouts; the other witnesses still cosign."""
    import socket  # noqa: PLC0415
    import time  # noqa: PLC0415

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000:
                if stop.is_set():
                    return
                conn.sendall(bytes([byte]))
                time.sleep(0.05)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    ledger = open_ledger(sqlite_url)
    slow_key = WitnessKey.generate("witness.slow.example")
    endpoints = [
        WitnessEndpoint(f"http://127.0.0.1:{listener.getsockname()[1]}", slow_key.verifier_key()),
        WitnessEndpoint(served, wkey.verifier_key()),
    ]
    started = time.monotonic()
    try:
        outcome = request_cosignatures(
            endpoints, _grow(ledger, 3), ledger.consistency_proof, timeout=0.5
        )
        # And the late exchange's thread and socket do not live on while the witness drips (a
        # re-test found one left behind per checkpoint): its socket is shut down.
        for _ in range(40):
            if not any(t.name.startswith("kvguard-witness") for t in threading.enumerate()):
                break
            time.sleep(0.05)
        lingering = [t.name for t in threading.enumerate() if t.name.startswith("kvguard-wit")]
    finally:
        stop.set()
        listener.close()
    assert lingering == []
    assert time.monotonic() - started < 5  # the drip alone would take over 50 s
    assert outcome.witnesses[slow_key.name].status is Status.ERROR
    assert "no answer within" in outcome.witnesses[slow_key.name].reason
    assert outcome.cosigned == [wkey.name]


def test_client_retries_from_the_witness_size_after_409(
    served: str, wkey: WitnessKey, open_ledger: Opener, sqlite_url: str, key: SigningKey
) -> None:
    ledger = open_ledger(sqlite_url)
    endpoint = WitnessEndpoint(served, wkey.verifier_key())
    first = request_cosignatures([endpoint], _grow(ledger, 5), ledger.consistency_proof)
    assert first.witnesses[wkey.name].status is Status.OK
    second_note = _grow(ledger, 4)
    # No known size: `old 0` gets a 409 naming size 5, then a proof from 5 succeeds.
    second = request_cosignatures([endpoint], second_note, ledger.consistency_proof)
    assert second.cosigned == [wkey.name] and second.known_sizes() == {wkey.name: 9}
    assert note.open_note(second.note, [key.verifier()])[0] == note.split_note(second_note)[0]
    assert require_cosignatures(second.note, [wkey.verifier_key()], 1) == [wkey.name]
    origin_hash = hashlib.sha256(ORIGIN.encode()).hexdigest()
    with urllib.request.urlopen(f"{served}/{origin_hash}/checkpoint", timeout=5) as r:
        monitored = r.read().decode()
    assert require_cosignatures(monitored, [wkey.verifier_key()], 1)
    assert note.split_note(monitored)[0] == note.split_note(second_note)[0]


# -- end to end: two `kvguard witness serve` processes ---------------------------------------------


def test_end_to_end_two_witnesses_cosign_and_refuse_a_rewritten_ledger(
    tmp_path: Path, key: SigningKey
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    witnesses = [WitnessProcess(tmp_path, n, key.verifier_key()) for n in ("w1", "w2")]
    try:
        endpoints = [WitnessEndpoint(w.url(), w.vkey) for w in witnesses]
        vkeys = [w.vkey for w in witnesses]
        ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
        try:
            first = request_cosignatures(endpoints, _grow(ledger, 20), ledger.consistency_proof)
            assert first.cosigned == ["w1.kvguard.test", "w2.kvguard.test"], first.witnesses
            assert require_cosignatures(first.note, vkeys, 2)
            assert note.open_note(first.note, [key.verifier()])
            second = request_cosignatures(
                endpoints, _grow(ledger, 13), ledger.consistency_proof, first.known_sizes()
            )
            assert require_cosignatures(second.note, vkeys, 2)
            assert second.known_sizes() == {"w1.kvguard.test": 33, "w2.kvguard.test": 33}
        finally:
            ledger.close()
        witnessed = [w.latest() for w in witnesses]
        assert [s.size if s else None for s in witnessed] == [33, 33]

        rewrite_history(tmp_path / "ledger.db", 7)
        forged = Ledger.open(url, origin=ORIGIN, signing_key=key)
        try:
            same_size = forged.checkpoint()  # the ledger signs the rewritten history
            assert note.split_note(same_size)[0] != note.split_note(second.note)[0]
            refused = request_cosignatures(
                endpoints, same_size, forged.consistency_proof, second.known_sizes()
            )
            larger = request_cosignatures(endpoints, _grow(forged, 5), forged.consistency_proof)
        finally:
            forged.close()
        for outcome in (refused, larger):
            assert outcome.cosigned == []
            assert {o.status for o in outcome.witnesses.values()} == {Status.CONFLICT}
            with pytest.raises(VerificationError, match="only 0 of the 2 required"):
                require_cosignatures(outcome.note, vkeys, 2)
        assert [w.latest() for w in witnesses] == witnessed  # nothing moved
        # Cosignatures do not transfer: the honest ones pasted onto the fork fail to verify.
        honest_lines = note.split_note(second.note)[1]
        pasted = note.join_note(
            note.split_note(same_size)[0],
            [note.signature_line(n, r[:4], r[4:]) for n, r in honest_lines],
        )
        with pytest.raises(VerificationError, match="does not verify"):
            require_cosignatures(pasted, vkeys, 2)
        assert all("possible log fork" in w.log.read_text() for w in witnesses)
    finally:
        exit_codes = [w.stop() for w in witnesses]
    assert exit_codes == [0, 0]  # SIGTERM shuts the server down cleanly


def test_a_witness_that_is_down_is_an_error_outcome_not_an_exception(
    served: str, wkey: WitnessKey, open_ledger: Opener, sqlite_url: str
) -> None:
    ledger = open_ledger(sqlite_url)
    down = WitnessKey.generate("down.kvguard.test")
    endpoints = [
        WitnessEndpoint(served, wkey.verifier_key()),
        WitnessEndpoint(f"http://127.0.0.1:{free_port()}", down.verifier_key()),
    ]
    outcome = request_cosignatures(endpoints, _grow(ledger, 3), ledger.consistency_proof, timeout=2)
    assert outcome.witnesses[down.name].status is Status.ERROR
    assert "unreachable" in outcome.witnesses[down.name].reason
    assert outcome.cosigned == [wkey.name]
    vkeys = [wkey.verifier_key(), down.verifier_key()]
    assert require_cosignatures(outcome.note, vkeys, 1) == [wkey.name]
    with pytest.raises(VerificationError, match="only 1 of the 2 required"):
        require_cosignatures(outcome.note, vkeys, 2)


def test_witness_key_command_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "w.key"
    runner = CliRunner()
    assert (
        runner.invoke(app, ["keys", "witness-key", "w.kvguard.test", "--out", str(out)]).exit_code
        == 0
    )
    again = runner.invoke(app, ["keys", "witness-key", "w.kvguard.test", "--out", str(out)])
    assert again.exit_code == 2
    bad = runner.invoke(
        app,
        [
            "witness",
            "serve",
            "--key",
            str(out),
            "--log",
            "nonsense",
            "--state",
            str(tmp_path / "s.db"),
        ],
    )
    assert bad.exit_code == 2


@pytest.mark.parametrize(
    "log_option",
    [ORIGIN, f"{ORIGIN}=", f"{ORIGIN}=abc", "log.example+0ac1fa72+bad", "PRIVATE+KEY+x+1+2"],
    ids=["origin only", "empty key", "no key", "malformed key", "a private key"],
)
def test_a_bad_log_option_says_the_form_it_expects(tmp_path: Path, log_option: str) -> None:
    """`witness serve --log ORIGIN` (the key left out) said only "verifier key must have the form
    name+keyid+base64key", naming neither the option nor ORIGIN=VKEY; the value is never echoed
    (a private key pasted by mistake is a secret)."""
    wkey_file = tmp_path / "w.key"
    WitnessKey.generate("w.kvguard.test").save(wkey_file)
    args = ["witness", "serve", "--key", str(wkey_file), "--log", log_option]
    bad = CliRunner().invoke(app, [*args, "--state", str(tmp_path / "s.db"), "--new-state"])
    assert bad.exit_code == 2, bad.output
    assert bad.stderr.startswith(f"usage error: {LOG_OPTION_FORM}; "), bad.stderr
    assert "ORIGIN=VKEY" in bad.stderr and "NAME+KEYID+BASE64KEY" in bad.stderr
    assert log_option not in bad.stderr.replace(LOG_OPTION_FORM, "")
    assert not (tmp_path / "s.db").exists()


def test_a_witness_without_its_state_file_refuses_to_start(tmp_path: Path, key: SigningKey) -> None:
    """A witness started on a missing state file holds no size for any log and cosigns whatever it
    is sent, a rewritten history included: refused unless `--new-state` asks for a new witness,
    which in turn never replaces an existing state file."""
    wkey_file = tmp_path / "w.key"
    runner = CliRunner()
    made = runner.invoke(app, ["keys", "witness-key", "w.kvguard.test", "--out", str(wkey_file)])
    assert made.exit_code == 0, made.output
    state = tmp_path / "state.db"
    base = ["witness", "serve", "--key", str(wkey_file), "--log", f"{ORIGIN}={key.verifier_key()}"]
    base += ["--state", str(state), "--listen", "127.0.0.1:0"]  # both refused before serving
    missing = runner.invoke(app, base)
    assert missing.exit_code == 2 and "--new-state" in missing.output and not state.exists()
    # A first start that cannot listen leaves no state behind: the same command runs again.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = [*base[:-1], f"127.0.0.1:{taken.getsockname()[1]}", "--new-state"]
        failed = runner.invoke(app, busy)
    assert failed.exit_code == 2 and not state.exists(), failed.output
    WitnessState(state).close()  # a witness's state, as a first start with --new-state makes it
    again = runner.invoke(app, [*base, "--new-state"])
    assert again.exit_code == 2 and "exists" in again.output


def test_an_https_witness_stuck_in_its_handshake_is_ended_at_the_deadline() -> None:
    """A witness that accepts the connection and never answers the TLS handshake: its socket is
    shut at the deadline like a plain one (the standard connection shakes hands inside
    `wrap_socket`, out of the reaper's reach: the thread lived until its socket timeout)."""
    import time  # noqa: PLC0415

    from kvguard.audit import witness_client  # noqa: PLC0415

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # accepts (the kernel does) and never says a word
        endpoint = WitnessEndpoint(
            f"https://127.0.0.1:{silent.getsockname()[1]}",
            WitnessKey.generate("witness.tls.example").verifier_key(),
        )

        def exchange() -> witness_client.WitnessOutcome:
            witness_client._post(endpoint, b"x", timeout=8)
            return witness_client.WitnessOutcome(Status.ERROR, "answered")

        started = time.monotonic()
        outcome = witness_client._within(1.0, {"tls": exchange})
        assert "no answer within" in outcome["tls"].reason
        while any(t.name.startswith("kvguard-witness") for t in threading.enumerate()):
            assert time.monotonic() - started < 4, "the exchange lived on past its deadline"
            time.sleep(0.05)
