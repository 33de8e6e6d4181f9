"""Real witness processes and a DDL rewrite of a ledger file, shared by the witness tests."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvguard.audit import merkle
from kvguard.audit.leaf import prepare_entry
from kvguard.audit.witness import LogState, WitnessState
from kvguard.cli import app

from .conftest import ORIGIN, make_event


def kvguard_command() -> list[str]:
    exe = Path(sys.executable).with_name("kvguard")
    return (
        [str(exe)]
        if exe.exists()
        else [sys.executable, "-c", "from kvguard.cli import main; main()"]
    )


class WitnessProcess:
    """`kvguard witness serve` on a free port, witnessing the log `ORIGIN` signed by `log_vkey`."""

    def __init__(self, tmp: Path, name: str, log_vkey: str) -> None:
        key_file = tmp / f"{name}.key"
        created = CliRunner().invoke(
            app, ["keys", "witness-key", f"{name}.kvguard.test", "--out", str(key_file)]
        )
        assert created.exit_code == 0, created.output
        self.vkey = created.output.strip()
        self.state = tmp / f"{name}.db"
        args = ["witness", "serve", "--key", str(key_file), "--log", f"{ORIGIN}={log_vkey}"]
        args += ["--state", str(self.state), "--listen", "127.0.0.1:0"]
        if not self.state.exists():
            args.append("--new-state")
        env = {**os.environ, "KVGUARD_LOG_LEVEL": "WARNING"}
        self.log = tmp / f"{name}.log"
        with self.log.open("w") as log:  # a file, not a pipe: a full pipe would block the server
            self.proc = subprocess.Popen(
                [*kvguard_command(), *args], stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )

    def url(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert " listening on " in line, self.log.read_text()
        return line.split(" listening on ")[1].split(" ")[0]

    def latest(self) -> LogState | None:
        state = WitnessState(self.state)
        try:
            return state.latest(ORIGIN)
        finally:
            state.close()

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rewrite_history(db: Path, index: int) -> None:
    """What an attacker with DDL rights does: lift the append-only triggers, replace one leaf,
    recompute every stored hash so the tree is self-consistent, forget the checkpoints, restore."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    triggers = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
    for name, _ in triggers:
        conn.execute(f'DROP TRIGGER "{name}"')
    forged = prepare_entry(make_event(index, details={"note": "rewritten"}))
    conn.execute(
        "UPDATE ledger_entries SET leaf = ?, leaf_hash = ?, kind = ?, scope_tag = ?, "
        "request_id = ?, ts_us = ? WHERE idx = ?",
        (
            forged.leaf,
            forged.leaf_hash,
            forged.kind,
            forged.scope_tag,
            forged.request_id,
            forged.ts_us,
            index,
        ),
    )
    conn.execute("DELETE FROM ledger_hashes")
    frontier = merkle.Frontier(0, [])
    for (leaf_hash,) in conn.execute(
        "SELECT leaf_hash FROM ledger_entries ORDER BY idx"
    ).fetchall():
        conn.executemany(
            "INSERT INTO ledger_hashes (id, hash) VALUES (?, ?)", frontier.append(leaf_hash)
        )
    conn.execute("DELETE FROM ledger_checkpoints")
    conn.execute("UPDATE ledger_head SET checkpoint_size = NULL")
    for _, sql in triggers:
        conn.execute(sql)
    conn.execute("COMMIT")
    conn.close()
