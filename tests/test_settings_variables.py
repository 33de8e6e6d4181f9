"""Issue 13, item 8: one variable per setting across all commands. The audit commands read the
database, origin and signing key from the same variables as `kvguard serve`, with the same
defaults; nothing reads the retired KVGUARD_LEDGER_URL / KVGUARD_POLICY_URL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.cli import app

from .audit.conftest import make_event

ROOT = Path(__file__).resolve().parents[1]


def test_audit_commands_take_the_servers_variables_and_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(data))
    monkeypatch.chdir(tmp_path)
    for name in ("KVGUARD_DB_URL", "KVGUARD_LEDGER_ORIGIN", "KVGUARD_SIGNING_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    created = CliRunner().invoke(app, ["keys", "signing-key", "kvguard.local/ledger"])
    assert created.exit_code == 0, created.output
    key = SigningKey.load(data / "ledger-signing.key")
    url = f"sqlite:///{(data / 'kvguard.db').resolve()}"  # Settings.database_url()'s default
    ledger = Ledger.open(url, origin="kvguard.local/ledger", signing_key=key)
    ledger.append_many([make_event(i) for i in range(5)])
    ledger.close()
    # no --db, --origin, --key: the defaults every command shares
    signed = CliRunner().invoke(app, ["audit", "checkpoint", "--json"])
    assert signed.exit_code == 0, signed.output
    assert '"tree_size": 5' in signed.stdout and '"origin": "kvguard.local/ledger"' in signed.stdout
    # the same through the variables
    other = tmp_path / "other.key"
    SigningKey.generate("log.example/x").save(other)
    monkeypatch.setenv("KVGUARD_DB_URL", url)
    monkeypatch.setenv("KVGUARD_LEDGER_ORIGIN", "kvguard.local/ledger")
    monkeypatch.setenv("KVGUARD_SIGNING_KEY_FILE", str(data / "ledger-signing.key"))
    assert CliRunner().invoke(app, ["audit", "verify-db"]).exit_code == 0


def test_no_command_reads_a_retired_or_second_variable() -> None:
    code = "\n".join(p.read_text() for p in (ROOT / "kvguard").rglob("*.py"))
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    for retired in ("KVGUARD_LEDGER_URL", "KVGUARD_POLICY_URL"):
        assert retired not in code and retired not in docs
    used = set(re.findall(r"KVGUARD_[A-Z_]+[A-Z]", code))
    # parent -> worker processes of `kvguard serve --workers`: its settings and its logging
    internal = {"KVGUARD_API_CONFIG", "KVGUARD_SERVER_LOGGING"}
    undocumented = sorted(v for v in used - internal if v not in docs)
    assert undocumented == [], undocumented
