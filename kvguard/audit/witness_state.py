"""Durable witness state: per log origin, the latest checkpoint this witness cosigned.

Owned by `WitnessState` alone: one SQLite file (standard library `sqlite3`), created 0600. Every
update is one `BEGIN IMMEDIATE` transaction that reads, decides and writes, so the check of the old
size and the write of the new state are atomic, also between several witness processes sharing the
file (c2sp.org/tlog-witness, "add-checkpoint", describes the rollback race this prevents). Triggers
refuse any update that would shrink a log or change its root at equal size, whatever code runs.

Besides the state, refused checkpoints that were validly signed by the log but inconsistent with
what the witness saw are kept (bounded per origin) as evidence of log misbehaviour: tlog-witness
allows it ("the witness MAY log the request").
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from kvguard.errors import AuditError

_MAX_EVIDENCE_PER_ORIGIN = 100  # bounds what a misbehaving but validly signing log can make us keep
_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS witness_logs (
    origin TEXT PRIMARY KEY NOT NULL,
    size INTEGER NOT NULL CHECK (size >= 0),
    root BLOB NOT NULL CHECK (length(root) = 32),
    note TEXT NOT NULL,
    cosigned_at INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS witness_logs_never_back BEFORE UPDATE ON witness_logs
WHEN NEW.origin <> OLD.origin OR NEW.size < OLD.size OR (NEW.size = OLD.size AND NEW.root <> OLD.root)
BEGIN SELECT RAISE(ABORT, 'kvguard witness: a log state never goes backwards or forks'); END;
CREATE TRIGGER IF NOT EXISTS witness_logs_no_delete BEFORE DELETE ON witness_logs
BEGIN SELECT RAISE(ABORT, 'kvguard witness: log states are never deleted'); END;
CREATE TABLE IF NOT EXISTS witness_refusals (
    id INTEGER PRIMARY KEY,
    origin TEXT NOT NULL,
    received_at INTEGER NOT NULL,
    old_size INTEGER NOT NULL,
    reason TEXT NOT NULL,
    note TEXT NOT NULL
);
"""


class LogState(NamedTuple):
    """What the witness last cosigned for one origin."""

    size: int
    root: bytes
    note: str  # the log-signed checkpoint with this witness's cosignature appended
    cosigned_at: int  # POSIX seconds


class Refusal(NamedTuple):
    """A validly signed checkpoint the witness refused as inconsistent (evidence of a fork)."""

    received_at: int
    old_size: int
    reason: str
    note: str


class WitnessState:
    """Durable per-origin witness state in a SQLite file created 0600 (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(mode=0o600, exist_ok=True)  # SQLite gives its -wal/-shm files this mode
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute("PRAGMA synchronous = FULL")  # a cosigned state survives power loss
        version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        if version > _SCHEMA_VERSION:
            self._conn.close()
            raise AuditError(f"witness state {self.path} has a newer schema ({version})")
        try:  # one script, one transaction: two processes may create the file at once
            self._conn.executescript(
                f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version = {_SCHEMA_VERSION};COMMIT;"
            )
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            self._conn.close()
            raise

    def latest(self, origin: str) -> LogState | None:
        with self._lock:
            return self._read(origin)

    def refusals(self, origin: str) -> list[Refusal]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT received_at, old_size, reason, note FROM witness_refusals "
                "WHERE origin = ? ORDER BY id",
                (origin,),
            ).fetchall()
        return [Refusal(int(r[0]), int(r[1]), str(r[2]), str(r[3])) for r in rows]

    def origins(self) -> list[str]:
        with self._lock:
            return [str(r[0]) for r in self._conn.execute("SELECT origin FROM witness_logs")]

    @contextmanager
    def transaction(self, origin: str) -> Iterator[LogSlot]:
        """Lock the state file, yield the origin's slot, commit on exit (roll back on error)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield LogSlot(self._conn, origin, self._read(origin))
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _read(self, origin: str) -> LogState | None:
        row = self._conn.execute(
            "SELECT size, root, note, cosigned_at FROM witness_logs WHERE origin = ?", (origin,)
        ).fetchone()
        return None if row is None else LogState(int(row[0]), bytes(row[1]), row[2], int(row[3]))

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class LogSlot:
    """One origin's state inside a `WitnessState.transaction`."""

    def __init__(self, conn: sqlite3.Connection, origin: str, current: LogState | None) -> None:
        self._conn, self.origin, self.current = conn, origin, current

    def store(self, new: LogState) -> None:
        if self.current is not None and new.size < self.current.size:
            raise AuditError("a witness never moves a log back")  # internal invariant, see triggers
        self._conn.execute(
            "INSERT INTO witness_logs (origin, size, root, note, cosigned_at) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (origin) DO UPDATE SET size = excluded.size, root = excluded.root, "
            "note = excluded.note, cosigned_at = excluded.cosigned_at",
            (self.origin, new.size, new.root, new.note, new.cosigned_at),
        )
        self.current = new

    def keep_evidence(self, refusal: Refusal) -> None:
        (kept,) = self._conn.execute(
            "SELECT count(*) FROM witness_refusals WHERE origin = ?", (self.origin,)
        ).fetchone()
        if int(kept) < _MAX_EVIDENCE_PER_ORIGIN:
            self._conn.execute(
                "INSERT INTO witness_refusals (origin, received_at, old_size, reason, note) "
                "VALUES (?, ?, ?, ?, ?)",
                (self.origin, *refusal),
            )
