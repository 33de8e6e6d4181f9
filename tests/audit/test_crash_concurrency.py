"""Item 10, processes: a writer killed with SIGKILL loses no entry whose append had returned, and two
processes appending to one PostgreSQL ledger at once produce one consistent, gapless log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey

_WRITER = textwrap.dedent(
    """
    import sys
    import time
    from datetime import UTC, datetime, timedelta
    from pathlib import Path
    from kvguard.audit.events import AuditEvent
    from kvguard.audit.ledger import Ledger
    from kvguard.audit.signing import SigningKey

    url, key_file, tag, count, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    ledger = Ledger.open(url, origin="log.kvguard.test/procs", signing_key=SigningKey.load(key_file))
    if len(sys.argv) > 6:  # start barrier: wait until every writer is ready, so they really overlap
        barrier, parties = Path(sys.argv[6]), int(sys.argv[7])
        (barrier / tag).touch()
        while len(list(barrier.iterdir())) < parties:
            time.sleep(0.01)
    t0 = datetime(2026, 11, 26, tzinfo=UTC)
    n = 0
    while count == 0 or n < count:
        events = [AuditEvent(kind="block.alloc", scope_tag=tag, block_ids=[n + i],
                             details={"seq": n + i}, ts=t0 + timedelta(microseconds=n + i))
                  for i in range(batch)]
        indices = ledger.append_many(events) if batch > 1 else [ledger.append(events[0])]
        for i, index in enumerate(indices):  # reported only after the append returned (durable)
            print(index, n + i, flush=True)
        n += batch
    ledger.close()
    """
)


def _spawn(
    tmp_path: Path, url: str, key_file: Path, tag: str, count: int, batch: int, *barrier: str
) -> subprocess.Popen[str]:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    return subprocess.Popen(
        [sys.executable, str(script), url, str(key_file), tag, str(count), str(batch), *barrier],
        stdout=subprocess.PIPE,
        text=True,
    )


def _seqs(ledger: Ledger, tag: str) -> dict[int, int]:
    out: dict[int, int] = {}
    page = ledger.query(scope_tag=tag, limit=10_000)
    while True:
        out.update({r.index: int(r.event.details["seq"]) for r in page.records})  # type: ignore[arg-type]
        if page.next_after is None:
            return out
        page = ledger.query(scope_tag=tag, limit=10_000, after=page.next_after)


@pytest.mark.parametrize("batch", [1, 50])
def test_sigkill_mid_stream_loses_no_returned_append(
    tmp_path: Path, key: SigningKey, batch: int
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    key_file = key.save(tmp_path / "k")
    Ledger.open(url, origin="log.kvguard.test/procs", signing_key=key).close()  # migrate first
    proc = _spawn(tmp_path, url, key_file, "st-crash", 0, batch)
    assert proc.stdout is not None
    acknowledged: list[tuple[int, int]] = []
    deadline = time.monotonic() + 60
    while len(acknowledged) < 400 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            index, seq = line.split()
            acknowledged.append((int(index), int(seq)))
    os.kill(proc.pid, signal.SIGKILL)  # mid-stream: it was appending as fast as it could
    proc.wait()
    proc.stdout.close()
    assert len(acknowledged) >= 400
    with Ledger.open(url, origin="log.kvguard.test/procs", signing_key=key) as ledger:
        stored = _seqs(ledger, "st-crash")
        assert all(stored.get(index) == seq for index, seq in acknowledged)
        assert sorted(stored) == list(range(ledger.size))  # gapless, nothing half-written
        ledger.checkpoint()
        assert ledger.verify().size == ledger.size


@pytest.mark.postgres
def test_two_processes_appending_to_postgres_make_one_consistent_log(
    tmp_path: Path, key: SigningKey, pg_url: str
) -> None:
    key_file = key.save(tmp_path / "k")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [
        _spawn(tmp_path, pg_url, key_file, tag, 600, batch, str(barrier), "2")
        for tag, batch in (("st-proc-a", 7), ("st-proc-b", 1))
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    with Ledger.open(pg_url, origin="log.kvguard.test/procs", signing_key=key) as ledger:
        assert ledger.size == 1_200 + 2  # 600 each, batch 7 rounds 600 up to 602
        spans = []
        for tag, out in zip(("st-proc-a", "st-proc-b"), outputs, strict=True):
            reported = {int(i): int(s) for i, s in (line.split() for line in out.splitlines())}
            assert _seqs(ledger, tag) == reported
            spans.append((min(reported), max(reported)))
        (a_lo, a_hi), (b_lo, b_hi) = spans
        assert a_lo < b_hi and b_lo < a_hi  # the writers really interleaved
        ledger.checkpoint()
        report = ledger.verify()
        assert report.size == ledger.size
