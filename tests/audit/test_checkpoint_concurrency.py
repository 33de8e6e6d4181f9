"""Checkpoints asked for (`Ledger.checkpoint_recorded`, the API's `POST /v1/audit/checkpoints`) under
concurrency and kill -9: each signed checkpoint covers the request that asked for it (the entry at
index size - 1), neither is ever stored without the other, and the log with all its checkpoints
verifies, while other threads and another process append and sign periodic checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.events import AuditEvent, EventKind
from kvguard.audit.ledger import Ledger
from kvguard.audit.note import open_note, split_note
from kvguard.audit.signing import SigningKey

from .conftest import make_event

Opener = Callable[..., Ledger]


def _request(tag: str) -> AuditEvent:
    return AuditEvent(
        kind=EventKind.ADMIN_ACTION,
        ts=datetime.now(UTC),
        request_id=tag,
        details={"action": "audit.checkpoint", "outcome": "ok"},
    )


def _size(signed: str) -> int:
    return parse_checkpoint(split_note(signed)[0]).size


def _leaf(ledger: Ledger, index: int) -> dict[str, object]:
    page = ledger.query(limit=1, after=index - 1) if index else ledger.query(limit=1)
    record = page.records[0]
    assert record.index == index
    leaf: dict[str, object] = json.loads(record.leaf)
    return leaf


def _checkpoint_requests(ledger: Ledger) -> dict[int, str]:
    """index -> request id of every checkpoint request entry in the log."""
    found: dict[int, str] = {}
    after = None
    while True:
        page = ledger.query(limit=500, kinds=[EventKind.ADMIN_ACTION.value], after=after)
        for record in page.records:
            leaf = json.loads(record.leaf)
            if leaf["details"].get("action") == "audit.checkpoint":
                found[record.index] = leaf["request_id"]
        if page.next_after is None:
            return found
        after = page.next_after


def _stored_sizes(ledger: Ledger) -> list[int]:
    with ledger.store.engine.connect() as conn:
        return [row.size for row in ledger.store.checkpoints(conn)]


def test_concurrent_requests_each_get_a_checkpoint_covering_their_own_entry(
    open_ledger: Opener, db_url: str
) -> None:
    one, two = open_ledger(db_url), open_ledger(db_url)  # two writers, as two processes
    returned: dict[str, str] = {}  # request id -> signed checkpoint
    errors: list[BaseException] = []
    lock = threading.Lock()

    def asker(ledger: Ledger, name: str) -> None:
        try:
            for n in range(6):
                tag = f"{name}-{n}"
                signed = ledger.checkpoint_recorded(_request(tag))
                with lock:
                    returned[tag] = signed
        except BaseException as exc:
            errors.append(exc)

    def appender(ledger: Ledger, base: int) -> None:
        try:
            for n in range(12):
                ledger.append_many([make_event(base + 3 * n + i) for i in range(3)])
                if n % 4 == 3:
                    ledger.checkpoint()  # a periodic checkpoint, interleaved
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=asker, args=(one, "a")),
        threading.Thread(target=asker, args=(two, "b")),
        threading.Thread(target=asker, args=(one, "c")),
        threading.Thread(target=appender, args=(one, 0)),
        threading.Thread(target=appender, args=(two, 1000)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(returned) == 18
    requests = _checkpoint_requests(one)
    assert sorted(requests.values()) == sorted(returned)  # each request recorded once
    stored = _stored_sizes(one)
    for tag, signed in returned.items():
        open_note(signed, one.verifiers())  # signed by the log's key
        size = _size(signed)
        assert requests.get(size - 1) == tag, "the checkpoint does not end with its request"
        assert size in stored
    assert stored == sorted(set(stored))  # one checkpoint per size, the chain in order
    report = one.verify()  # every checkpoint matches the tree, the log recomputes
    assert report.checkpoints == len(stored)
    assert report.size == 18 + 2 * 12 * 3


_ASKER = textwrap.dedent(
    """
    import sys
    from datetime import UTC, datetime
    from kvguard.audit.checkpoint import parse_checkpoint
    from kvguard.audit.events import AuditEvent, EventKind
    from kvguard.audit.ledger import Ledger
    from kvguard.audit.note import split_note
    from kvguard.audit.signing import SigningKey

    url, key_file = sys.argv[1], sys.argv[2]
    ledger = Ledger.open(url, origin="log.kvguard.test/audit", signing_key=SigningKey.load(key_file))
    n = 0
    while True:
        event = AuditEvent(kind=EventKind.ADMIN_ACTION, ts=datetime.now(UTC), request_id=f"k-{n}",
                           details={"action": "audit.checkpoint", "outcome": "ok"})
        signed = ledger.checkpoint_recorded(event)
        print(f"k-{n}", parse_checkpoint(split_note(signed)[0]).size, flush=True)
        n += 1
    """
)


def test_kill_9_never_leaves_a_checkpoint_without_its_request_or_one_without_the_other(
    open_ledger: Opener, db_url: str, key: SigningKey, tmp_path: Path
) -> None:
    key_file = key.save(tmp_path / "key")
    script = tmp_path / "asker.py"
    script.write_text(_ASKER)
    ledger = open_ledger(db_url)
    ledger.append_many([make_event(i) for i in range(5)])
    answered: dict[str, int] = {}
    for round_ in range(3):
        child = subprocess.Popen(
            [sys.executable, str(script), db_url, str(key_file)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while len(answered) < 4 * (round_ + 1) and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            tag, size = line.split()
            answered[f"{round_}/{tag}"] = int(size)
        time.sleep(0.003 * round_)  # land the kill at different points of the next call
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        for line in child.stdout.read().splitlines():  # answers printed before the kill
            tag, size = line.split()
            answered[f"{round_}/{tag}"] = int(size)
        ledger.append_many([make_event(100 + round_)])  # the log goes on after each crash
    assert len(answered) >= 12
    requests = _checkpoint_requests(ledger)
    stored = set(_stored_sizes(ledger))
    # Every checkpoint request in the log has its checkpoint and every checkpoint of a request
    # size has its request: the two were committed together or not at all.
    assert {index + 1 for index in requests} <= stored
    for asked, at in answered.items():
        assert at in stored and requests.get(at - 1) == asked.split("/")[1]
    report = ledger.verify()
    assert report.checkpoints == len(stored)
