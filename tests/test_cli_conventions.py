"""Issue 13, item 5: one set of CLI conventions (`kvguard.cli_output`, docs/cli.md).

- every command that reports a result takes `--json`, and then stdout is exactly one JSON object;
- errors with `--json` are `{"error": ..., "exit_code": N}` on stdout too, the message on stderr;
- one exit-code table: 0 ok, 1 invalid / failed check, 2 usage or environment error;
- progress bars only when stderr is a terminal, never with `--json`.

Typer's `CliRunner` (typer 0.29, which vendors its own click) takes no `mix_stderr`: it always keeps
`result.stdout` and `result.stderr` apart (`result.output` interleaves both, as click >= 8.2 does), so
stdout is parsed on its own here.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner, Result

from kvguard import cli_output
from kvguard.audit import export, merkle, verify_db
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.cli import app
from kvguard.control.tenants import TenantRegistry
from tests.audit.conftest import make_event
from tests.dbs import PG_URL, sqlite_with_tenants

runner = CliRunner()
ORIGIN = "log.kvguard.test/conventions"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "policies"
MALFORMED = Path(__file__).resolve().parent / "policy" / "fixtures" / "malformed.yaml"
UNREACHABLE = "postgresql+psycopg://kvguard:s3cret-pw@127.0.0.1:1/nowhere"


@dataclass(frozen=True)
class LedgerFiles:
    db: Path
    key_file: Path
    vkey: str

    @property
    def url(self) -> str:
        return f"sqlite:///{self.db}"

    def common(self) -> list[str]:
        return ["--db", self.url, "--origin", ORIGIN, "--key", str(self.key_file)]


def make_ledger(tmp_path: Path, entries: int = 30) -> LedgerFiles:
    """A SQLite ledger with `entries` entries and its signing key file (0600)."""
    key = SigningKey.generate("log.kvguard.test")
    key_file = tmp_path / "signing.key"
    key.save(key_file)
    db = tmp_path / "ledger.db"
    ledger = Ledger.open(f"sqlite:///{db}", origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(entries)])
    ledger.close()
    return LedgerFiles(db, key_file, key.verifier_key())


def _stdout_object(result: Result) -> dict[str, Any]:
    obj = json.loads(result.stdout)  # the whole of stdout: one JSON document
    assert isinstance(obj, dict)
    assert result.stdout == json.dumps(obj, indent=2, sort_keys=True) + "\n"  # sorted keys
    return obj


def ok_json(args: list[str]) -> dict[str, Any]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return _stdout_object(result)


def failed_json(args: list[str], code: int) -> dict[str, Any]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == code, result.output
    obj = _stdout_object(result)
    assert obj["exit_code"] == code and obj["error"], obj
    assert obj["error"] in result.stderr  # the human message goes to stderr
    assert "Traceback" not in result.output
    return obj


# -- --json on every result-reporting command --------------------------------------------------


def test_key_file_commands_report_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path / "data"))
    ring = ok_json(["keys", "salt-keyring", "--out", str(tmp_path / "salt.keys")])
    assert ring == {
        "active": "k1",
        "key_ids": ["k1"],
        "path": str(tmp_path / "salt.keys"),
        "rotated": False,
    }
    rotated = ok_json(
        ["keys", "salt-keyring", "--out", str(tmp_path / "salt.keys"), "--rotate", "k2"]
    )
    assert (rotated["active"], rotated["key_ids"], rotated["rotated"]) == ("k2", ["k1", "k2"], True)
    signing = ok_json(["keys", "signing-key", "log.example", "--out", str(tmp_path / "s.key")])
    assert set(signing) == {"name", "path", "verifier_key"}
    assert signing["verifier_key"].startswith("log.example+")
    shown = ok_json(["keys", "verifier-key", str(tmp_path / "s.key")])
    assert shown == signing
    witness = ok_json(["keys", "witness-key", "w.example"])  # default path: stderr says where
    assert witness["path"] == str(tmp_path / "data" / "witness.key")
    for obj in (ring, rotated, signing, witness):
        assert "PRIVATE" not in json.dumps(obj)  # never a private key


def test_admin_key_commands_report_json(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'k.db'}"
    ok_json(["db", "migrate", "--db", db])  # a --db database is not made by `keys create`
    created = ok_json(["keys", "create", "--role", "auditor", "--label", "ci", "--db", db])
    assert set(created) == {"api_key", "key_id", "label", "role", "tenant_id"}
    assert created["api_key"].startswith(f"kvg_adm_{created['key_id']}_")  # shown once, on purpose
    revoked = ok_json(["keys", "revoke", created["key_id"], "--db", db])
    assert revoked == {"key_id": created["key_id"], "revoked": True}


def test_tenant_key_commands_report_json(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    ok_json(["db", "migrate", "--db", url])
    assert ok_json(["keys", "tenant-key", "list", "--db", url]) == {"keys": []}
    TenantRegistry(sa.create_engine(url)).create("acme", display_name="Acme", created_by="t")
    created = ok_json(["keys", "tenant-key", "create", "acme", "--db", url])
    assert set(created) == {"api_key", "key_id", "tenant_id"}
    listed = ok_json(["keys", "tenant-key", "list", "--db", url])
    (row,) = listed["keys"]
    assert row["key_id"] == created["key_id"] and created["api_key"] not in json.dumps(listed)
    revoked = ok_json(["keys", "tenant-key", "revoke", created["key_id"], "--db", url])
    assert revoked == {
        "key_id": created["key_id"],
        "revoked": True,
        "tenant_id": "acme",
        "already_revoked": False,
    }


def test_purge_reports_json(tmp_path: Path) -> None:
    queued = ok_json(
        ["purge", "--db", sqlite_with_tenants(tmp_path / "c.db", "acme"), "--tenant", "acme"]
    )
    assert queued == {
        "acks": [],
        "command_id": 1,
        "live_engines": 0,
        "selector": {"kind": "tenant", "tenant_id": None, "value": "acme"},
    }


def _live_engine(url: str) -> None:
    """An engine registered on `url` and live now (it never acknowledges anything)."""
    import time  # noqa: PLC0415

    from kvguard.control.db import open_engine  # noqa: PLC0415
    from kvguard.control.engines import EngineRegistry  # noqa: PLC0415

    engine = open_engine(url)
    EngineRegistry(engine).register(
        "engine-1", model="tiny", block_size=32, num_blocks=64, now=time.time()
    )
    engine.dispose()


def test_db_commands_report_json(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    first = ok_json(["db", "migrate", "--db", url])
    assert set(first) == {"control", "database", "ledger"}
    assert first["ledger"]["before"] is None and first["ledger"]["after"]
    assert first["control"]["before"] is None and first["control"]["after"]
    again = ok_json(["db", "migrate", "--db", url])  # idempotent: nothing to do
    assert again["ledger"]["before"] == again["ledger"]["after"] == first["ledger"]["after"]
    grants = ok_json(["db", "grants", "kvguard_app"])
    assert grants["role"] == "kvguard_app" and grants["statements"]


def test_policy_commands_report_json() -> None:
    files = sorted(str(p) for p in EXAMPLES.glob("*.yaml"))
    validated = ok_json(["policy", "validate", *files])
    assert validated["valid"] is True
    assert [f["file"] for f in validated["files"]] == files
    assert all(f["valid"] and f["problems"] == [] for f in validated["files"])
    digest = ok_json(["policy", "digest", files[0]])
    assert set(digest) == {"digest", "file"} and digest["digest"].startswith("sha256:")


def test_audit_commands_report_json(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    signed = ok_json(["audit", "checkpoint", *led.common(), "--out", str(tmp_path / "cp")])
    assert set(signed) == {
        "checkpoint", "cosigned_by", "delivered", "origin", "out", "root", "tree_size", "witnesses"
    }  # fmt: skip
    assert (signed["origin"], signed["tree_size"], signed["cosigned_by"]) == (ORIGIN, 30, [])
    assert (tmp_path / "cp").read_text() == signed["checkpoint"]
    exported = ok_json(["audit", "export", *led.common(), "--out", str(tmp_path / "b")])
    assert set(exported) == {
        "checkpoint", "complete", "cosigned_by", "delivered", "entries", "path", "tree_size",
        "witnesses",
    }  # fmt: skip
    assert (exported["entries"], exported["tree_size"], exported["complete"]) == (30, 30, True)
    checked = ok_json(["audit", "verify-db", *led.common(), "--max-unsigned-age", "0"])
    assert checked["valid"] is True and checked["entries"] == 30 and checked["checkpoints"] == 1
    args = ["verify", str(tmp_path / "b"), "--key", led.vkey, "--origin", ORIGIN, "--full"]
    verified = ok_json([*args, "--save-checkpoint", str(tmp_path / "kept")])
    assert verified["valid"] is True and verified["kind"] == "bundle"
    assert (verified["origin"], verified["tree_size"], verified["entries"]) == (ORIGIN, 30, 30)
    assert verified["root_recomputed"] is True
    assert verified["saved_checkpoint"] == str(tmp_path / "kept")


def test_a_checkpoint_missing_the_cosignatures_asked_for_exits_1(tmp_path: Path) -> None:
    """`audit checkpoint --witness W` with W down exited 0: a script never saw the cosignature
    was missing. The checkpoint is still signed, printed and saved; the exit is 1, each witness's
    outcome is in the JSON and on stderr; `--min-witnesses 0` accepts none."""
    from kvguard.audit.cosign import WitnessKey  # noqa: PLC0415
    from tests.audit.witness_helpers import free_port  # noqa: PLC0415

    led = make_ledger(tmp_path)
    wkey = WitnessKey.generate("witness.down.example")
    down = ["--witness", f"http://127.0.0.1:{free_port()}={wkey.verifier_key()}"]
    out = tmp_path / "cp"
    short = failed_json(["audit", "checkpoint", *led.common(), *down, "--out", str(out)], 1)
    assert short["error"] == "0 of the 1 witness cosignatures needed"
    assert short["witnesses"]["witness.down.example"]["status"] == "error"
    assert out.read_text() == short["checkpoint"] and short["tree_size"] == 30
    accepted = ok_json(["audit", "checkpoint", *led.common(), *down, "--min-witnesses", "0"])
    assert accepted["cosigned_by"] == []
    usage = failed_json(["audit", "checkpoint", *led.common(), *down, "--min-witnesses", "2"], 2)
    assert "--min-witnesses 2" in usage["error"]
    # An export alike: the bundle is written, the exit says the cosignature is missing.
    bundle = tmp_path / "b"
    exported = failed_json(["audit", "export", *led.common(), *down, "--out", str(bundle)], 1)
    assert exported["error"] == "0 of the 1 witness cosignatures needed"
    assert exported["entries"] == 30 and (bundle / "checkpoint").exists()


def test_a_checkpoint_of_a_mistyped_database_is_refused_not_made(tmp_path: Path) -> None:
    """`audit checkpoint --db` at a mistyped SQLite path created a new, empty ledger there and
    signed its checkpoint of size 0, exit 0."""
    led = make_ledger(tmp_path)
    typo = tmp_path / "ledgr.db"
    args = ["audit", "checkpoint", "--db", f"sqlite:///{typo}", "--origin", ORIGIN]
    refused = failed_json([*args, "--key", str(led.key_file)], 2)
    assert "does not exist" in refused["error"] and not typo.exists()


def test_checkpoint_and_export_deliver_what_the_command_line_queued(tmp_path: Path) -> None:
    """Operator changes made on the command line (a key, a purge) wait in the control outbox
    for the admin API to deliver them; without a server running, `audit export` said `complete`
    with 0 entries and `audit checkpoint` signed size 0 (found by a review)."""
    led = make_ledger(tmp_path, entries=0)
    ok_json(["keys", "create", "--role", "auditor", "--db", led.url])
    url = sqlite_with_tenants(tmp_path / "ledger.db", "acme")
    assert url == led.url
    ok_json(["purge", "--db", led.url, "--tenant", "acme"])
    signed = ok_json(["audit", "checkpoint", *led.common()])
    assert (signed["delivered"], signed["tree_size"]) == (2, 2)
    exported = ok_json(["audit", "export", *led.common(), "--out", str(tmp_path / "b")])
    assert (exported["delivered"], exported["entries"], exported["complete"]) == (0, 2, True)


def test_demo_without_vllm_reports_a_json_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util  # noqa: PLC0415

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert "pip install" in failed_json(["demo"], 2)["error"]


@pytest.mark.parametrize("where", ["variable", "option"])
def test_a_bad_log_level_is_a_json_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """`KVGUARD_LOG_LEVEL=loud kvguard demo --json` printed a plain "usage error" line and no
    JSON: the root option is checked before the subcommand has parsed its `--json`."""
    if where == "variable":
        monkeypatch.setenv("KVGUARD_LOG_LEVEL", "loud")
        args = ["policy", "digest", str(EXAMPLES / "default-secure.yaml")]
    else:
        args = ["--log-level", "loud", "policy", "digest", str(EXAMPLES / "default-secure.yaml")]
    failed = failed_json(args, 2)
    assert failed["error"].startswith("KVGUARD_LOG_LEVEL (or --log-level): ")
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in failed["error"]
    assert "loud" not in failed["error"]  # named, never echoed: it may be a misplaced secret
    plain = runner.invoke(app, args)  # without --json: the message on stderr only
    assert (plain.exit_code, plain.stdout) == (2, "")
    assert plain.stderr == f"error: {failed['error']}\n"


def _pg_reachable() -> bool:
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect():
            return True
    except sa.exc.OperationalError:
        return False
    finally:
        engine.dispose()


def test_an_unknown_postgresql_database_is_named(tmp_path: Path) -> None:
    """`--db postgresql+psycopg://127.0.0.1:5432/nosuchdb` said "cannot open database ...:
    OperationalError" (`audit verify-db`: "cannot be read (OperationalError)"), as for a server
    that is down. Now the server's reason, with the URL's host, port and database; no password."""
    if not _pg_reachable():
        pytest.skip(f"PostgreSQL not reachable at {PG_URL}")
    name = f"nosuchdb_{uuid.uuid4().hex[:8]}"
    pg = sa.engine.make_url(PG_URL)
    # Without a password of its own the server trusts the role: one put in the URL is ignored.
    url = pg.set(database=name, password=pg.password or "s3cret-pw")
    db = url.render_as_string(hide_password=False)
    led = make_ledger(tmp_path, entries=1)
    for args in (
        ["db", "migrate", "--db", db],
        ["audit", "verify-db", "--db", db, "--origin", ORIGIN, "--key", str(led.key_file)],
        ["keys", "tenant-key", "list", "--db", db],
    ):
        error = failed_json(args, 2)["error"]
        assert f'refused the connection: database "{name}" does not exist' in error, error
        assert cli_output.safe_url(db) in error  # its host, port and database
        assert str(url.password) not in error and ":***@" in error


def test_db_migrate_says_what_it_did(tmp_path: Path) -> None:
    """On a new database `kvguard db migrate` printed "ledger schema up to date" although it had
    just created every table."""
    url = f"sqlite:///{tmp_path / 'new.db'}"
    first = runner.invoke(app, ["db", "migrate", "--db", url])
    assert first.exit_code == 0, first.output
    done = ok_json(["db", "migrate", "--db", f"sqlite:///{tmp_path / 'other.db'}"])
    ledger, control = done["ledger"]["after"], done["control"]["after"]
    assert first.stdout == (
        f"ledger schema: migrated from nothing to {ledger}\n"
        f"control schema: migrated from nothing to {control}\n"
    )
    again = runner.invoke(app, ["db", "migrate", "--db", url])
    assert again.stdout == (
        f"ledger schema: already at {ledger} (up to date)\n"
        f"control schema: already at {control} (up to date)\n"
    )


# -- one exit-code table -----------------------------------------------------------------------


def _usage_cases(tmp_path: Path, led: LedgerFiles) -> dict[str, list[str]]:
    bundle = tmp_path / "bundle"
    (bundle / "x").mkdir(parents=True)  # a non-empty directory
    loose = tmp_path / "loose.key"
    loose.write_bytes(led.key_file.read_bytes())
    loose.chmod(0o644)
    unreachable = ["--db", UNREACHABLE, "--origin", ORIGIN, "--key", str(led.key_file)]
    return {
        "verify: no such path": ["verify", str(tmp_path / "none"), "--key", led.vkey],
        "verify: malformed key": ["verify", str(bundle), "--key", "not-a-key"],
        "policy validate: no such file": ["policy", "validate", str(tmp_path / "none.yaml")],
        "policy validate: a directory": ["policy", "validate", str(tmp_path)],
        "policy digest: no such file": ["policy", "digest", str(tmp_path / "none.yaml")],
        "verifier-key: no such file": ["keys", "verifier-key", str(tmp_path / "none.key")],
        "checkpoint: key readable by others": [
            "audit",
            "checkpoint",
            "--db",
            led.url,
            "--origin",
            ORIGIN,
            "--key",
            str(loose),
        ],
        "checkpoint: database unreachable": ["audit", "checkpoint", *unreachable],
        "export: database unreachable": ["audit", "export", *unreachable, "--out", str(bundle)],
        "export: refuses a non-empty directory": [
            "audit",
            "export",
            *led.common(),
            "--out",
            str(bundle),
        ],
        "verify-db: database unreachable": ["audit", "verify-db", *unreachable],
        "verify-db: bad duration": [
            "audit",
            "verify-db",
            *led.common(),
            "--max-unsigned-age",
            "soon",
        ],
        "db migrate: database unreachable": ["db", "migrate", "--db", UNREACHABLE],
        "db grants: bad role": ["db", "grants", "Robert'); DROP TABLE"],
        "keys create: bad role": ["keys", "create", "--role", "root", "--db", led.url],
        "keys create: database unreachable": [
            "keys",
            "create",
            "--role",
            "admin",
            "--db",
            UNREACHABLE,
        ],
        "keys revoke: database unreachable": ["keys", "revoke", "0" * 12, "--db", UNREACHABLE],
        "tenant-key list: database unreachable": [
            "keys",
            "tenant-key",
            "list",
            "--db",
            UNREACHABLE,
        ],
        "purge: no selector": ["purge", "--db", led.url],
        "purge: database unreachable": ["purge", "--db", UNREACHABLE, "--tenant", "acme"],
        "signing-key: refuses to overwrite": [
            "keys",
            "signing-key",
            "x.example",
            "--out",
            str(led.key_file),
        ],
        "witness-key: refuses to overwrite": [
            "keys",
            "witness-key",
            "w.example",
            "--out",
            str(led.key_file),
        ],
        "salt-keyring: refuses to overwrite": [
            "keys",
            "salt-keyring",
            "--out",
            str(led.key_file),
        ],
    }


USAGE_CASES = [  # the keys of `_usage_cases` (test_every_usage_case_is_run keeps them in step)
    "verify: no such path",
    "verify: malformed key",
    "policy validate: no such file",
    "policy validate: a directory",
    "policy digest: no such file",
    "verifier-key: no such file",
    "checkpoint: key readable by others",
    "checkpoint: database unreachable",
    "export: database unreachable",
    "export: refuses a non-empty directory",
    "verify-db: database unreachable",
    "verify-db: bad duration",
    "db migrate: database unreachable",
    "db grants: bad role",
    "keys create: bad role",
    "keys create: database unreachable",
    "keys revoke: database unreachable",
    "tenant-key list: database unreachable",
    "purge: no selector",
    "purge: database unreachable",
    "signing-key: refuses to overwrite",
    "witness-key: refuses to overwrite",
    "salt-keyring: refuses to overwrite",
]


@pytest.mark.parametrize("case", USAGE_CASES)
def test_usage_and_environment_errors_exit_2(tmp_path: Path, case: str) -> None:
    led = make_ledger(tmp_path, entries=3)
    before = led.key_file.read_bytes()
    failed = failed_json(_usage_cases(tmp_path, led)[case], 2)
    assert "s3cret-pw" not in json.dumps(failed)  # a database URL is printed without its password
    assert led.key_file.read_bytes() == before  # nothing overwritten


def test_every_usage_case_is_run(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, entries=1)
    assert sorted(_usage_cases(tmp_path, led)) == sorted(USAGE_CASES)


def _drop_triggers_and(db: Path, statement: str, *params: object) -> None:
    """What someone with DDL rights (or the file) can do behind the append path's back."""
    raw = sqlite3.connect(db, isolation_level=None)
    names = [n for (n,) in raw.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")]
    for name in names:
        raw.execute(f'DROP TRIGGER "{name}"')
    raw.execute(statement, params)
    raw.close()


def _corrupt_first_subtree(db: Path) -> None:
    _drop_triggers_and(
        db,
        "UPDATE ledger_hashes SET hash = ? WHERE id = ?",
        b"\x55" * 32,
        merkle.stored_hash_key(3, 0),
    )


def test_a_tampered_bundle_is_invalid(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    assert ok_json(["audit", "export", *led.common(), "--out", str(tmp_path / "b")])
    entries = tmp_path / "b" / "entries.jsonl"
    entries.write_text(entries.read_text().replace('"n1"', '"n9"', 1))
    failed = failed_json(["verify", str(tmp_path / "b"), "--key", led.vkey, "--origin", ORIGIN], 1)
    assert (failed["valid"], failed["kind"]) == (False, "bundle")


def test_a_tampered_database_is_invalid(tmp_path: Path) -> None:
    led = make_ledger(tmp_path)
    _corrupt_first_subtree(led.db)
    failed = failed_json(["audit", "verify-db", *led.common(), "--max-unsigned-age", "0"], 1)
    assert failed["valid"] is False


def test_a_rewritten_log_is_not_signed(tmp_path: Path) -> None:
    led = make_ledger(tmp_path, entries=8)
    assert ok_json(["audit", "checkpoint", *led.common()])["tree_size"] == 8
    _corrupt_first_subtree(led.db)  # entries 0..7, covered by the signed checkpoint
    refused = failed_json(["audit", "checkpoint", *led.common()], 1)
    assert "changed since it was signed: refusing to sign" in refused["error"]


def test_invalid_policies_exit_1() -> None:
    good = str(EXAMPLES / "default-secure.yaml")
    failed = failed_json(["policy", "validate", good, str(MALFORMED)], 1)
    assert failed["valid"] is False
    assert [f["valid"] for f in failed["files"]] == [True, False]
    problems = failed["files"][1]["problems"]
    assert "tenants.globex.retention.ttl_s" in {p["field"] for p in problems}
    digest = failed_json(["policy", "digest", str(MALFORMED)], 1)
    assert digest["valid"] is False and digest["problems"]


def test_unknown_keys_and_tenants_exit_1(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    ok_json(["db", "migrate", "--db", url])
    failed_json(["keys", "revoke", "0" * 12, "--db", url], 1)
    failed_json(["keys", "tenant-key", "revoke", "0" * 12, "--db", url], 1)
    failed_json(["keys", "tenant-key", "create", "nobody", "--db", url], 1)


def test_an_unacknowledged_purge_exits_1(tmp_path: Path) -> None:
    url = sqlite_with_tenants(tmp_path / "c.db", "acme")
    _live_engine(url)
    args = ["purge", "--db", url, "--tenant", "acme", "--wait", "0.3"]
    failed = failed_json(args, 1)
    assert failed["command_id"] == 1 and failed["acks"] == [] and failed["live_engines"] == 1


def test_a_purge_with_no_live_engine_waits_for_none(tmp_path: Path) -> None:
    """With no engine live none holds the blocks (an engine's cache dies with it) and none would
    acknowledge: `--wait` ended in "no engine acknowledged", exit 1, for a job the API shows done
    (found by a docs review). Exit 0 at once, saying so."""
    url = sqlite_with_tenants(tmp_path / "c.db", "acme")
    args = ["purge", "--db", url, "--tenant", "acme", "--wait", "30", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "no engine was live" in result.stderr
    assert _stdout_object(result)["live_engines"] == 0


def test_purge_uses_the_embedded_database_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As every other command: no --db means the SQLite file under KVGUARD_DATA_DIR (it said
    "Missing option '--db'"); one that does not exist is refused, nothing made."""
    monkeypatch.delenv("KVGUARD_DB_URL", raising=False)
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    missing = failed_json(["purge", "--tenant", "acme"], 2)
    assert "does not exist" in missing["error"] and not (tmp_path / "kvguard.db").exists()
    sqlite_with_tenants(tmp_path / "kvguard.db", "acme")
    assert ok_json(["purge", "--tenant", "acme"])["command_id"] == 1


def test_exit_code_table_is_one_function() -> None:
    from kvguard.errors import (  # noqa: PLC0415
        ConfigError,
        LogRewrittenError,
        NotFoundError,
        SecretFileError,
        VerificationError,
    )

    assert cli_output.exit_code_for(VerificationError("x")) == cli_output.EXIT_INVALID
    assert cli_output.exit_code_for(LogRewrittenError("x")) == cli_output.EXIT_INVALID
    assert cli_output.exit_code_for(NotFoundError("x")) == cli_output.EXIT_INVALID
    assert cli_output.exit_code_for(ConfigError("x")) == cli_output.EXIT_USAGE
    assert cli_output.exit_code_for(SecretFileError("x")) == cli_output.EXIT_USAGE
    assert cli_output.exit_code_for(OSError("x")) == cli_output.EXIT_USAGE


# -- progress only on a terminal ---------------------------------------------------------------


LONG_WORK = {
    "export": lambda led, tmp: ["audit", "export", *led.common(), "--out", str(tmp / "b")],
    "verify-db": lambda led, tmp: ["audit", "verify-db", *led.common(), "--max-unsigned-age", "0"],
    "db migrate": lambda led, tmp: ["db", "migrate", "--db", f"sqlite:///{tmp / 'm.db'}"],
}
BAR_TEXT = {"export": "exporting", "verify-db": "verifying", "db migrate": "migrating"}


@pytest.mark.parametrize("command", list(LONG_WORK))
def test_progress_only_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    led = make_ledger(tmp_path)
    args = LONG_WORK[command](led, tmp_path)
    plain = runner.invoke(app, args)  # CliRunner's stderr is not a terminal
    assert plain.exit_code == 0, plain.output
    assert BAR_TEXT[command] not in plain.stderr
    monkeypatch.setattr(cli_output, "_is_tty", lambda _stream: True)
    args = LONG_WORK[command](led, tmp_path / "again")  # a fresh export directory / database
    (tmp_path / "again").mkdir()
    shown = runner.invoke(app, args)
    assert shown.exit_code == 0, shown.output
    assert BAR_TEXT[command] in shown.stderr and BAR_TEXT[command] not in shown.stdout
    (tmp_path / "json").mkdir()
    as_json = runner.invoke(app, [*LONG_WORK[command](led, tmp_path / "json"), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert BAR_TEXT[command] not in as_json.stderr  # never with --json, even on a terminal
    _stdout_object(as_json)


def test_verify_progress_only_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    led = make_ledger(tmp_path)
    assert ok_json(["audit", "export", *led.common(), "--out", str(tmp_path / "b")])
    args = ["verify", str(tmp_path / "b"), "--key", led.vkey, "--origin", ORIGIN]
    assert "verifying" not in runner.invoke(app, args).stderr
    monkeypatch.setattr(cli_output, "_is_tty", lambda _stream: True)
    assert "verifying" in runner.invoke(app, args).stderr
    assert "verifying" not in runner.invoke(app, [*args, "--json"]).stderr


def test_export_and_verify_db_report_progress_every_few_thousand_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export, "_PROGRESS_EVERY", 10)
    monkeypatch.setattr(verify_db, "_CHUNK", 10)
    led = make_ledger(tmp_path)
    ledger = Ledger.open(led.url, origin=ORIGIN, signing_key=SigningKey.load(led.key_file))
    try:
        calls: list[tuple[int, int]] = []
        ledger.export(tmp_path / "b", progress=lambda done, total: calls.append((done, total)))
        assert calls == [(10, 30), (20, 30), (30, 30), (30, 30)]
        calls.clear()
        ledger.export(
            tmp_path / "f", scope_tag="st-tenant0", progress=lambda d, t: calls.append((d, t))
        )
        assert calls == [(10, 0), (10, 10)]  # a filter hides the total until the end
        calls.clear()
        ledger.verify(progress=lambda done, total: calls.append((done, total)))
        assert calls == [(10, 30), (20, 30), (30, 30)]
    finally:
        ledger.close()
