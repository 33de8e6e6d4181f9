"""Export bundles and the offline verifier (`kvguard verify`): valid bundles pass, any single flipped
byte fails with exit 1 naming what failed, usage errors exit 2, and the verifier module imports
nothing but `cryptography` and the standard library."""

from __future__ import annotations

import csv
import io
import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvguard.audit import bundle
from kvguard.audit.cli import audit_app, keys_app, verify_command
from kvguard.audit.ledger import Ledger
from kvguard.audit.manifest import Manifest, file_digest, format_manifest, parse_manifest
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError

from .conftest import ORIGIN, T0, make_event

Opener = Callable[..., Ledger]


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("verify")(verify_command)
    app.add_typer(audit_app, name="audit")
    app.add_typer(keys_app, name="keys")
    return app


def _verify(
    directory: Path, *keys: str, full: bool = False, origin: str | None = ORIGIN
) -> tuple[int, str]:
    args = ["verify", str(directory), *[a for k in keys for a in ("--key", k)]]
    args += ["--origin", origin] if origin else []
    result = CliRunner().invoke(_app(), [*args, *(["--full"] if full else [])])
    return result.exit_code, result.output


def _ledger(open_ledger: Opener, url: str, n: int) -> Ledger:
    ledger = open_ledger(url)
    ledger.append_many([make_event(i) for i in range(n // 2)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(n // 2, n)])
    ledger.append(make_event(n, payload={"user": "erin"}))
    return ledger


def test_offline_verifier_imports_only_cryptography_and_stdlib() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import kvguard.audit.offline\n"
        "mods = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(' '.join(sorted(m for m in mods if m not in sys.stdlib_module_names)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    third_party = set(out.stdout.split())
    # `_openssl` / `_cffi_backend` are cryptography's own compiled bindings; `__mp_main__` is the
    # alias of `__main__` that the standard library's multiprocessing registers on import.
    allowed = {"kvguard", "cryptography", "_openssl", "_cffi_backend", "__mp_main__"}
    assert third_party <= allowed, third_party
    assert {"kvguard", "cryptography"} <= third_party


def test_complete_export_verifies_fully(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    ledger = _ledger(open_ledger, sqlite_url, 200)
    summary = ledger.export(tmp_path / "b", tlog_proofs=True)
    assert (summary.entries, summary.tree_size, summary.complete) == (201, 201, True)
    names = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert names == [
        "checkpoint",
        "consistency.jsonl",
        "entries.csv",
        "entries.jsonl",
        "entries.ocsf.jsonl",
        "manifest",
        "payloads.jsonl",
        "proofs",
    ]
    report = verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)
    assert (report.entries, report.consistency_proofs, report.tlog_proofs) == (201, 1, 201)
    code, out = _verify(tmp_path / "b", key.verifier_key(), full=True)
    assert code == 0 and "valid: 201 entries" in out and "root recomputed" in out
    verify_bundle(tmp_path / "b", [key.verifier_key()], origin="log.kvguard.test/audit")
    with pytest.raises(VerificationError, match="origin"):
        verify_bundle(tmp_path / "b", [key.verifier_key()], origin="other.example/log")
    first = json.loads((tmp_path / "b" / "entries.jsonl").read_text().splitlines()[0])
    assert first["index"] == 0 and first["event"]["kind"] == "block.alloc"
    assert b"erin" not in b"".join(p.read_bytes() for p in (tmp_path / "b").glob("entries*"))


def test_filtered_export_verifies_but_is_not_complete(
    db_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    ledger = _ledger(open_ledger, db_url, 90)
    summary = ledger.export(tmp_path / "t", scope_tag="st-tenant2", since=T0)
    assert summary.entries == len([i for i in range(90) if i % 3 == 2]) and not summary.complete
    code, out = _verify(tmp_path / "t", key.verifier_key())
    # The auditor sees which filters the signed manifest records, not only "filtered".
    assert code == 0 and '"scope_tag":"st-tenant2"' in out and '"since":' in out, out
    result = CliRunner().invoke(
        _app(),
        ["verify", str(tmp_path / "t"), "--key", key.verifier_key(), "--origin", ORIGIN, "--json"],
    )
    shown = json.loads(result.output)
    assert shown["complete"] is False and shown["selection"]["scope_tag"] == "st-tenant2"
    code, out = _verify(tmp_path / "t", key.verifier_key(), full=True)
    assert code == 1 and "complete log" in out


def test_wrong_key_and_usage_errors(sqlite_url: str, open_ledger: Opener, tmp_path: Path) -> None:
    ledger = _ledger(open_ledger, sqlite_url, 10)
    ledger.export(tmp_path / "b")
    other = SigningKey.generate("log.kvguard.test")
    code, out = _verify(tmp_path / "b", other.verifier_key())
    assert code == 1 and "checkpoint" in out and "trusted key" in out
    assert _verify(tmp_path / "nowhere", other.verifier_key())[0] == 2
    assert _verify(tmp_path / "b", "not-a-key")[0] == 2
    assert CliRunner().invoke(_app(), ["verify", str(tmp_path / "b")]).exit_code == 2


def test_rotated_keys_verify_with_either(
    sqlite_url: str, open_ledger: Opener, tmp_path: Path
) -> None:
    old, new = SigningKey.generate("log.a"), SigningKey.generate("log.b")
    ledger = open_ledger(sqlite_url, signing_key=[old, new])
    ledger.append_many([make_event(i) for i in range(5)])
    ledger.export(tmp_path / "b")
    assert _verify(tmp_path / "b", old.verifier_key())[0] == 0
    assert _verify(tmp_path / "b", new.verifier_key())[0] == 0


def test_csv_cells_are_never_spreadsheet_formulas_and_the_bundle_still_verifies(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """CSV injection (OWASP): a scope tag or request id that starts with `=`, `+`, `-` or `@` was
    written as is, and a spreadsheet opening `entries.csv` ran it as a formula. Each such cell is
    prefixed with `'` (and so is one that starts with `'`, so that dropping one leading `'` always
    gives the value back); the verifier regenerates the same rendering."""
    hostile = ['=HYPERLINK("http://evil.example","x")', "+1+1", "-2+3", "@SUM(A1)", "'=quoted"]
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i, scope_tag=v, request_id=v) for i, v in enumerate(hostile)])
    ledger.export(tmp_path / "b")
    text = (tmp_path / "b" / bundle.CSV).read_text()
    rows = list(csv.reader(io.StringIO(text)))[1:]
    for row, value in zip(rows, hostile, strict=True):
        assert (row[3], row[4]) == (f"'{value}", f"'{value}"), row
        assert all(cell[:1] not in {"=", "+", "-", "@", "\t", "\r"} for cell in row), row
    verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)
    # Tab and CR cannot reach a leaf (tags and ids are printable ASCII) but are neutralised alike;
    # a cell that is one integer in a numeric column stays a number.
    assert bundle.spreadsheet_cell("\tx") == "'\tx" and bundle.spreadsheet_cell("\rx") == "'\rx"
    assert bundle.spreadsheet_cell("-5", numeric=True) == "-5"
    assert bundle.spreadsheet_cell("-5") == "'-5"
    assert bundle.spreadsheet_cell("-5 6", numeric=True) == "'-5 6"
    assert bundle.spreadsheet_cell("st-tenant1") == "st-tenant1"


def test_a_bundle_exported_before_csv_neutralisation_still_verifies_and_is_reported(
    sqlite_url: str,
    open_ledger: Opener,
    key: SigningKey,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Archived evidence stays verifiable: a bundle the exporter wrote before 344b40e (every CSV
    cell as is, e.g. a client-chosen request id `-retry-1`) was rejected once the verifier
    regenerated entries.csv with the neutralised cells. It verifies again, in the legacy style
    for the whole file, reported (`csv_legacy`) and warned about by `kvguard verify`."""
    ledger = open_ledger(sqlite_url)
    ledger.append_many(
        [make_event(0, request_id="-retry-1"), make_event(1), make_event(2, scope_tag="=x")]
    )
    with monkeypatch.context() as patch:  # what the exporter wrote before 344b40e
        patch.setattr(bundle, "spreadsheet_cell", lambda value, *, numeric=False: value)
        ledger.export(tmp_path / "old")
    assert ",-retry-1," in (tmp_path / "old" / bundle.CSV).read_text()
    report = verify_bundle(tmp_path / "old", [key.verifier_key()], origin=ORIGIN, full=True)
    assert report.csv_legacy
    code, out = _verify(tmp_path / "old", key.verifier_key(), full=True)
    assert code == 0, out
    assert "WARNING: entries.csv predates CSV-injection neutralisation" in out
    assert "spreadsheet" in out
    args = ["verify", str(tmp_path / "old"), "--key", key.verifier_key(), "--origin", ORIGIN]
    machine = CliRunner().invoke(_app(), [*args, "--json"])
    assert machine.exit_code == 0 and json.loads(machine.stdout)["csv_legacy"] is True
    ledger.export(tmp_path / "new")  # today's bundle: not legacy, no warning
    assert not verify_bundle(tmp_path / "new", [key.verifier_key()], origin=ORIGIN).csv_legacy
    assert "entries.csv predates" not in _verify(tmp_path / "new", key.verifier_key())[1]


def test_an_entries_csv_mixing_legacy_and_neutralised_lines_fails(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """The legacy rendering is accepted for a whole file, never line by line: a file whose first
    hostile line is neutralised and whose second is not is no file kvguard wrote (a manifest
    signed for it does not help)."""
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(0, request_id="-retry-1"), make_event(1, request_id="@x")])
    ledger.export(tmp_path / "b")
    path = tmp_path / "b" / bundle.CSV
    lines = path.read_text().splitlines(keepends=True)
    assert lines[2].count("'@x") == 1
    path.write_text("".join([*lines[:2], lines[2].replace("'@x", "@x")]))
    signed = (tmp_path / "b" / "manifest").read_text()
    text = parse_manifest(signed.split("\n\n")[0] + "\n")
    files = {name: file_digest(tmp_path / "b" / name) for name in text.files}
    forged = format_manifest(Manifest(**{**text.__dict__, "files": files}))
    (tmp_path / "b" / "manifest").write_text(ledger.sign_note(forged))
    with pytest.raises(VerificationError, match=r"entries.csv \(entry 1\): mixes the legacy"):
        verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)


def _all_bytes(root: Path) -> list[tuple[Path, int]]:
    return [(p, i) for p in sorted(root.rglob("*")) if p.is_file() for i in range(p.stat().st_size)]


def test_flipping_any_single_byte_of_an_export_is_detected(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    ledger = _ledger(open_ledger, sqlite_url, 24)
    ledger.export(tmp_path / "b", tlog_proofs=True)
    positions = _all_bytes(tmp_path / "b")
    rng = random.Random(20261126)
    # every file's first and last byte, plus a seeded sample across all files
    picks = {(p, 0) for p, _ in positions} | {(p, p.stat().st_size - 1) for p, _ in positions}
    picks |= set(rng.sample(positions, 400))
    for path, offset in sorted(picks):
        data = path.read_bytes()
        flipped = bytearray(data)
        flipped[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(flipped))
        try:
            for full in (False, True):
                with pytest.raises(VerificationError):
                    verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=full)
        finally:
            path.write_bytes(data)
    verify_bundle(
        tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True
    )  # restored: valid again


def test_flipped_byte_in_a_large_export_names_the_entry(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    ledger = _ledger(open_ledger, sqlite_url, 3_000)
    ledger.export(tmp_path / "b", renderings=False)
    entries = tmp_path / "b" / bundle.ENTRIES
    lines = entries.read_text().splitlines(keepends=True)
    line = lines[1_234]
    pos = line.index('"inclusion_proof":["') + 25
    lines[1_234] = line[:pos] + ("A" if line[pos] != "A" else "B") + line[pos + 1 :]
    entries.write_text("".join(lines))
    for full in (False, True):
        code, out = _verify(tmp_path / "b", key.verifier_key(), full=full)
        assert code == 1 and "entry 1234" in out, out


def test_a_folder_in_place_of_a_proof_file_is_invalid_not_a_crash(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    ledger = _ledger(open_ledger, sqlite_url, 6)
    ledger.export(tmp_path / "b", tlog_proofs=True)
    proof = tmp_path / "b" / "proofs" / "3.tlog-proof"
    proof.unlink()
    proof.mkdir()
    code, out = _verify(tmp_path / "b", key.verifier_key())
    assert code == 1 and "3.tlog-proof" in out


def test_extra_files_are_refused(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    ledger = _ledger(open_ledger, sqlite_url, 6)
    ledger.export(tmp_path / "b")
    (tmp_path / "b" / "notes.txt").write_text("trust me\n")
    code, out = _verify(tmp_path / "b", key.verifier_key())
    assert code == 1 and "notes.txt" in out


def test_cli_keys_checkpoint_and_export(sqlite_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    created = runner.invoke(
        _app(), ["keys", "signing-key", "log.kvguard.test", "--out", str(tmp_path / "k")]
    )
    assert created.exit_code == 0
    vkey = created.output.strip()
    assert vkey.startswith("log.kvguard.test+")
    ledger = Ledger.open(sqlite_url, origin="o/1", signing_key=SigningKey.load(tmp_path / "k"))
    ledger.append_many([make_event(i) for i in range(30)])
    ledger.close()
    common = ["--db", sqlite_url, "--origin", "o/1", "--key", str(tmp_path / "k")]
    cp = runner.invoke(_app(), ["audit", "checkpoint", *common])
    assert cp.exit_code == 0 and cp.output.startswith("o/1\n30\n")
    out = runner.invoke(
        _app(),
        [
            "audit",
            "export",
            *common,
            "--out",
            str(tmp_path / "e"),
            "--tenant",
            "st-tenant0",
            "--tlog-proofs",
        ],
    )
    assert out.exit_code == 0, out.output
    assert len(list((tmp_path / "e" / "proofs").iterdir())) == 10
    assert _verify(tmp_path / "e", vkey, origin="o/1")[0] == 0
    code, out = _verify(tmp_path / "e", vkey, origin=None)  # key "log.kvguard.test", log "o/1"
    assert code == 2 and "--origin" in out
    again = runner.invoke(_app(), ["keys", "signing-key", "x", "--out", str(tmp_path / "k")])
    assert again.exit_code == 2  # never overwrites a key
