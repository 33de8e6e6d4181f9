"""Item 10: tampering with a ledger of a few thousand entries behind the triggers' back is detected.

A raw sqlite3 connection drops the append-only triggers (what someone with file access can do), then
each case edits one column of one row, deletes a row, swaps two rows or truncates the tail. Each must
be caught by `Ledger.verify()`, by `kvguard audit verify-db`, and - wherever the evidence itself
changed - by the export path plus the offline verifier `kvguard verify`. After each case the file is
restored and compared with a digest of the pristine tables, so every case starts from a valid ledger.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvguard.audit import merkle
from kvguard.audit.cli import audit_app, verify_command
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError

from .conftest import make_event

pytestmark = pytest.mark.slow

N = 3_000
ORIGIN = "log.kvguard.test/tamper"
TABLES = (
    "ledger_head",
    "ledger_entries",
    "ledger_entry_blocks",
    "ledger_hashes",
    "ledger_checkpoints",
    "ledger_payloads",
)
# Derived or side data: block links (a query index), payloads (outside the leaves by design) and the
# stored subtree hashes (a cache of what the leaves determine). An export rebuilds its proofs from
# the leaves, so its evidence is unchanged and valid; these edits are caught by the database-side
# checks (the export path also re-checks the entry columns, leaf hashes and checkpoint rows).
INDEX_ONLY = {"ledger_entry_blocks", "ledger_payloads", "ledger_hashes"}
_ENTRY_INDEX_COLUMNS = {("ledger_entries", c) for c in ("kind", "scope_tag", "request_id", "ts_us")}


class TamperDb:
    def __init__(self, path: Path, key_file: Path, key: SigningKey, workdir: Path) -> None:
        self.path, self.key_file, self.key, self.workdir = path, key_file, key, workdir
        self.url = f"sqlite:///{path}"
        self.raw = sqlite3.connect(path, isolation_level=None)
        for (name,) in self.raw.execute(
            "SELECT name FROM sqlite_master WHERE type='trigger'"
        ).fetchall():
            self.raw.execute(f"DROP TRIGGER {name}")
        self.pristine = self.digest()
        self.exports = 0

    def digest(self) -> str:
        h = hashlib.sha256()
        for table in TABLES:
            for row in self.raw.execute(f"SELECT * FROM {table} ORDER BY 1, 2"):
                h.update(repr(row).encode())
        return h.hexdigest()

    def pk(self, table: str) -> list[str]:
        info = sorted(self.raw.execute(f"PRAGMA table_info({table})"), key=lambda c: c[5])
        return [c[1] for c in info if c[5]]

    def columns(self, table: str) -> list[str]:
        return [c[1] for c in self.raw.execute(f"PRAGMA table_info({table})")]

    def run(self, sql: str, params: tuple[object, ...] = ()) -> None:
        self.raw.execute(sql, params)

    def restore(self, statements: list[tuple[str, tuple[object, ...]]]) -> None:
        for sql, params in statements:
            self.raw.execute(sql, params)
        assert self.digest() == self.pristine, "tamper case did not restore the ledger"

    def assert_detected(self, *, evidence: bool) -> None:
        ledger = Ledger.open(self.url, origin=ORIGIN, signing_key=self.key)
        try:
            with pytest.raises(VerificationError):
                ledger.verify()
            if evidence:
                self.assert_offline_detects(ledger)
        finally:
            ledger.close()
        app = typer.Typer()
        app.add_typer(audit_app, name="audit")
        result = CliRunner().invoke(
            app,
            [
                "audit",
                "verify-db",
                "--db",
                self.url,
                "--origin",
                ORIGIN,
                "--key",
                str(self.key_file),
            ],
        )
        assert result.exit_code == 1, result.output
        assert "INVALID" in result.output

    def assert_offline_detects(self, ledger: Ledger) -> None:
        """Either the exporter refuses, or `kvguard verify --full` rejects what it wrote."""
        self.exports += 1
        out = self.workdir / f"export-{self.exports}"
        try:
            ledger.export(out, renderings=False)
        except VerificationError:
            return
        app = typer.Typer()
        app.command()(verify_command)
        result = CliRunner().invoke(app, [str(out), "--key", self.key.verifier_key(), "--full"])
        assert result.exit_code == 1, result.output


@pytest.fixture(scope="module")
def tdb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TamperDb]:
    work = tmp_path_factory.mktemp("tamper")
    key = SigningKey.generate("log.kvguard.test")
    key_file = key.save(work / "signing.key")
    ledger = Ledger.open(f"sqlite:///{work / 'ledger.db'}", origin=ORIGIN, signing_key=key)
    for start in range(0, N, 1_000):
        ledger.append_many([make_event(i) for i in range(start, start + 1_000 - 3)])
        for i in range(3):
            ledger.append(make_event(start + 997 + i, payload={"user": f"user{start + i}"}))
        ledger.checkpoint()
    ledger.erase_payload(
        999, reason="data_subject_request"
    )  # one erasure record, so erasure is covered too
    ledger.checkpoint()
    ledger.close()
    db = TamperDb(work / "ledger.db", key_file, key, work)
    yield db
    db.raw.close()


def _changed(value: object) -> object:
    if isinstance(value, bytes):
        return value[:-1] + bytes([value[-1] ^ 0x01])
    if isinstance(value, int):
        return value + 10**9
    if value is None:
        return "st-forged"
    text = str(value)
    return (
        "block.evict"
        if text.startswith("block.")
        else text[:-1] + ("x" if text[-1] != "x" else "y")
    )


def _cases() -> Iterator[tuple[str, str]]:
    columns = {
        "ledger_head": ["size", "checkpoint_size"],
        "ledger_entries": ["idx", "leaf", "leaf_hash", "kind", "scope_tag", "request_id", "ts_us"],
        "ledger_entry_blocks": ["block_id", "idx"],
        "ledger_hashes": ["id", "hash"],
        "ledger_checkpoints": ["size", "root", "note", "prev_size"],
        "ledger_payloads": ["idx", "salt", "body"],
    }
    for table, cols in columns.items():
        for col in cols:
            yield table, col


@pytest.mark.parametrize(("table", "column"), list(_cases()), ids=str)
def test_editing_any_column_of_any_row_is_detected(tdb: TamperDb, table: str, column: str) -> None:
    pk = tdb.pk(table) or ["rowid"]
    keys = tdb.raw.execute(
        f"SELECT {', '.join(pk)} FROM {table} ORDER BY {', '.join(pk)}"
    ).fetchall()
    for key in dict.fromkeys([keys[0], keys[len(keys) // 2], keys[-1]]):
        where = " AND ".join(f"{c} = ?" for c in pk)
        (old,) = tdb.raw.execute(f"SELECT {column} FROM {table} WHERE {where}", key).fetchone()
        new = _changed(old)
        tdb.run(f"UPDATE {table} SET {column} = ? WHERE {where}", (new, *key))
        new_key = tuple(new if c == column else v for c, v in zip(pk, key, strict=True))
        # A checkpoint row whose note no longer verifies reads like one anyone with INSERT could
        # add (the true root under an unsigned note): an export leaves it out rather than let one
        # INSERT stop every later export; `verify()` and `verify-db` report it.
        # An entry's index columns are copies of its leaf for queries: a complete export selects
        # on none of them and carries the (untouched, proven) leaf, so it stays valid evidence
        # (refusing it let one INSERT with odd columns stop every later complete export); a
        # filtered export, `verify()` and `verify-db` still refuse the edit.
        evidence = (
            table not in INDEX_ONLY
            and (table, column) != ("ledger_checkpoints", "note")
            and (table, column) not in _ENTRY_INDEX_COLUMNS
        )
        try:
            tdb.assert_detected(evidence=evidence)
        finally:
            tdb.restore([(f"UPDATE {table} SET {column} = ? WHERE {where}", (old, *new_key))])


@pytest.mark.parametrize("table", TABLES)
def test_deleting_a_row_is_detected(tdb: TamperDb, table: str) -> None:
    pk = tdb.pk(table) or ["rowid"]
    cols = tdb.columns(table)
    keys = tdb.raw.execute(
        f"SELECT {', '.join(pk)} FROM {table} ORDER BY {', '.join(pk)}"
    ).fetchall()
    key = keys[len(keys) // 2]
    where = " AND ".join(f"{c} = ?" for c in pk)
    row = tdb.raw.execute(f"SELECT {', '.join(cols)} FROM {table} WHERE {where}", key).fetchone()
    tdb.run(f"DELETE FROM {table} WHERE {where}", key)
    marks = ", ".join("?" for _ in cols)
    try:
        tdb.assert_detected(evidence=table not in INDEX_ONLY)
    finally:
        tdb.restore([(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})", tuple(row))])


@pytest.mark.parametrize(
    ("table", "a", "b"),
    [
        ("ledger_entries", 10, 2_500),
        ("ledger_entries", 1_000, 1_001),
        ("ledger_hashes", None, None),
    ],
)
def test_swapping_two_rows_is_detected(
    tdb: TamperDb, table: str, a: int | None, b: int | None
) -> None:
    key = tdb.pk(table)[0]
    cols = [c for c in tdb.columns(table) if c != key]
    if a is None:
        a, b = [
            r[0]
            for r in tdb.raw.execute(f"SELECT {key} FROM {table} ORDER BY {key} LIMIT 2 OFFSET 40")
        ]
    ra = tdb.raw.execute(f"SELECT {', '.join(cols)} FROM {table} WHERE {key} = ?", (a,)).fetchone()
    rb = tdb.raw.execute(f"SELECT {', '.join(cols)} FROM {table} WHERE {key} = ?", (b,)).fetchone()
    setter = ", ".join(f"{c} = ?" for c in cols)
    tdb.run(f"UPDATE {table} SET {setter} WHERE {key} = ?", (*rb, a))
    tdb.run(f"UPDATE {table} SET {setter} WHERE {key} = ?", (*ra, b))
    try:
        tdb.assert_detected(evidence=table not in INDEX_ONLY)
    finally:
        tdb.restore(
            [
                (f"UPDATE {table} SET {setter} WHERE {key} = ?", (*ra, a)),
                (f"UPDATE {table} SET {setter} WHERE {key} = ?", (*rb, b)),
            ]
        )


def test_truncating_the_tail_is_detected(tdb: TamperDb) -> None:
    """Delete the last 5 entries with their links, payloads and hashes, and move the head back:
    a consistent-looking shorter log, caught by the checkpoints signed at the longer size."""
    (size,) = tdb.raw.execute("SELECT size FROM ledger_head").fetchone()
    cut = size - 5
    saved: list[tuple[str, tuple[object, ...]]] = []
    for table, cond in [
        ("ledger_entries", "idx >= ?"),
        ("ledger_entry_blocks", "idx >= ?"),
        ("ledger_payloads", "idx >= ?"),
        ("ledger_hashes", "1"),
    ]:
        cols = tdb.columns(table)
        rows = tdb.raw.execute(
            f"SELECT {', '.join(cols)} FROM {table} WHERE {cond}", (cut,) if "?" in cond else ()
        ).fetchall()
        marks = ", ".join("?" for _ in cols)
        saved += [
            (f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})", tuple(r)) for r in rows
        ]
        tdb.run(f"DELETE FROM {table} WHERE {cond}", (cut,) if "?" in cond else ())
    # rebuild the stored hashes for the shorter log, as a careful forger would
    shorter = Ledger.open(tdb.url, origin=ORIGIN, signing_key=tdb.key)
    shorter.close()
    tdb.run("UPDATE ledger_head SET size = ?", (cut,))
    _rebuild_hashes(tdb, cut)
    try:
        tdb.assert_detected(evidence=True)
    finally:
        tdb.run("DELETE FROM ledger_hashes")
        tdb.run("UPDATE ledger_head SET size = ?", (size,))
        tdb.restore(saved)


def _rebuild_hashes(tdb: TamperDb, size: int) -> None:
    leaves = [
        bytes(h) for (h,) in tdb.raw.execute("SELECT leaf_hash FROM ledger_entries ORDER BY idx")
    ]
    levels = merkle.tree_levels(leaves)
    for level in range(1, len(levels)):
        for index in range(size >> level):
            tdb.run(
                "INSERT INTO ledger_hashes (id, hash) VALUES (?, ?)",
                (merkle.stored_hash_key(level, index), levels[level][index]),
            )


def test_untouched_ledger_verifies(tdb: TamperDb) -> None:
    ledger = Ledger.open(tdb.url, origin=ORIGIN, signing_key=tdb.key)
    try:
        report = ledger.verify()
    finally:
        ledger.close()
    assert (report.size, report.checkpoints, report.erased) == (N + 1, 4, 1)
