"""Issue 12, items 1, 2, 5 and 7 through the commands auditors run.

- Pinning: `kvguard verify --save-checkpoint` keeps a checkpoint; `--trusted-checkpoint` then
  requires the bundle to prove its log extends it, and a history rewritten with DDL rights (every
  hash recomputed, checkpoint rows deleted) fails against it although it verifies on its own.
- Witnesses: `kvguard audit export --witness` gets the checkpoint cosigned by real witness
  processes; `kvguard verify --witness-key --min-witnesses` counts them; after the rewrite the
  witnesses refuse and the count fails.
- Completeness: deleted, reordered or duplicated lines, a deleted `consistency.jsonl`, `proofs/` or
  manifest, all fail; the origin must be pinned.
- Erasure offline: an erased payload is proven erased in the bundle (and the tenant's own export);
  a payload deleted straight from the database stops the export; a bundle whose `payloads.jsonl`
  leaves a commitment unaccounted for fails even when its manifest is re-signed.
- verify-db fails when entries older than the configured age are covered by no checkpoint.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvguard.audit import bundle, manifest
from kvguard.audit.cli import audit_app, verify_command
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import OriginNotPinnedError, verify_bundle
from kvguard.audit.payloads import PAYLOADS, ErasureReason
from kvguard.audit.signing import SigningKey
from kvguard.errors import AuditError, VerificationError

from .conftest import ORIGIN, T0, make_event
from .witness_helpers import WitnessProcess, rewrite_history

Opener = Callable[..., Ledger]


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("verify")(verify_command)
    app.add_typer(audit_app, name="audit")
    return app


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(_app(), list(args))
    return result.exit_code, result.output


@pytest.fixture
def signed(tmp_path: Path, key: SigningKey) -> tuple[str, Path, str]:
    """(ledger URL, signing key file, verifier key) of a ledger file with 20 entries."""
    key_file = tmp_path / "signing.key"
    key.save(key_file)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(20)])
    ledger.close()
    return url, key_file, key.verifier_key()


def _export(url: str, key_file: Path, out: Path, *extra: str, code: int = 0) -> str:
    got, output = _run(
        "audit", "export", "--db", url, "--origin", ORIGIN, "--key", str(key_file),
        "--out", str(out), *extra,
    )  # fmt: skip
    assert got == code, output
    return output


def _grow(url: str, key: SigningKey, n: int) -> None:
    ledger = Ledger.open(url, origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(ledger.size, ledger.size + n)])
    ledger.close()


def test_a_saved_checkpoint_pins_later_bundles_and_a_rewrite_fails_against_it(
    signed: tuple[str, Path, str], key: SigningKey, tmp_path: Path
) -> None:
    url, key_file, vkey = signed
    _export(url, key_file, tmp_path / "b1")
    pin = tmp_path / "pinned.checkpoint"
    code, out = _run("verify", str(tmp_path / "b1"), "--key", vkey, "--origin", ORIGIN,
                     "--save-checkpoint", str(pin))  # fmt: skip
    assert code == 0 and "checkpoint saved" in out, out
    _grow(url, key, 7)
    _export(url, key_file, tmp_path / "b2")
    code, out = _run(
        "verify", str(tmp_path / "b2"), "--key", vkey, "--trusted-checkpoint", str(pin)
    )
    assert code == 0 and "extends your trusted checkpoint of size 20" in out, out

    rewrite_history(tmp_path / "ledger.db", 3)  # DDL rights: one leaf changed, hashes recomputed
    _export(url, key_file, tmp_path / "b3")
    code, out = _run("verify", str(tmp_path / "b3"), "--key", vkey, "--origin", ORIGIN, "--full")
    assert code == 0, out  # on its own the rewritten log is self-consistent...
    code, out = _run(
        "verify", str(tmp_path / "b3"), "--key", vkey, "--trusted-checkpoint", str(pin)
    )
    assert code == 1 and "no consistency proof from it" in out, out  # ...but not to the auditor

    older = tmp_path / "b2-pin"
    assert _run("verify", str(tmp_path / "b2"), "--key", vkey, "--origin", ORIGIN,
                "--save-checkpoint", str(older))[0] == 0  # fmt: skip
    code, out = _run(
        "verify", str(tmp_path / "b1"), "--key", vkey, "--trusted-checkpoint", str(older)
    )
    assert code == 1 and "older than it" in out


def test_witnesses_cosign_exports_and_refuse_a_rewritten_log(
    signed: tuple[str, Path, str], key: SigningKey, tmp_path: Path
) -> None:
    url, key_file, vkey = signed
    witnesses = [WitnessProcess(tmp_path, n, vkey) for n in ("w1", "w2")]
    try:
        flags = [a for w in witnesses for a in ("--witness", f"{w.url()}={w.vkey}")]
        trust = [a for w in witnesses for a in ("--witness-key", w.vkey)]
        _export(url, key_file, tmp_path / "b1", *flags)
        code, out = _run("verify", str(tmp_path / "b1"), "--key", vkey, "--origin", ORIGIN,
                         *trust, "--min-witnesses", "2")  # fmt: skip
        assert code == 0 and "cosigned by 2 witnesses" in out, out
        _grow(url, key, 5)
        _export(url, key_file, tmp_path / "b2", *flags)  # consistency from the witnesses' size
        assert (
            _run("verify", str(tmp_path / "b2"), "--key", vkey, "--origin", ORIGIN, *trust)[0] == 0
        )
        assert [w.latest().size for w in witnesses] == [25, 25]  # type: ignore[union-attr]

        rewrite_history(tmp_path / "ledger.db", 3)
        _grow(url, key, 2)
        # The witnesses refuse; the export goes on, and its exit says the cosignatures are missing.
        out = _export(url, key_file, tmp_path / "b3", *flags, code=1)
        assert "0 of the 2 witness cosignatures needed" in out and (tmp_path / "b3").is_dir()
        code, out = _run("verify", str(tmp_path / "b3"), "--key", vkey, "--origin", ORIGIN, *trust)
        assert code == 1 and "only 0 of the 2 required witness cosignatures" in out, out
        assert [w.latest().size for w in witnesses] == [25, 25]  # type: ignore[union-attr]
        assert all("possible log fork" in w.log.read_text() for w in witnesses)
    finally:
        for w in witnesses:
            w.stop()


@pytest.fixture
def complete(open_ledger: Opener, sqlite_url: str, tmp_path: Path) -> Iterator[Path]:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(12)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(12, 30)])
    ledger.export(tmp_path / "b", tlog_proofs=True)
    yield tmp_path / "b"


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ls: ls[:5] + ls[6:], "holds entry 5 here"),
        (lambda ls: ls[:-1], "holds all 30 entries"),
        (lambda ls: [ls[1], ls[0], *ls[2:]], "holds entry 0 here"),
        (lambda ls: [*ls[:3], ls[2], *ls[3:]], "index is not an integer above the previous"),
    ],
    ids=["deleted", "tail deleted", "reordered", "duplicated"],
)
def test_plain_verify_detects_changed_line_sets_in_a_complete_bundle(
    complete: Path, key: SigningKey, change: Callable[[list[str]], list[str]], message: str
) -> None:
    entries = complete / bundle.ENTRIES
    entries.write_text("".join(change(_lines(entries))), encoding="utf-8")
    with pytest.raises(VerificationError, match=message):
        verify_bundle(complete, [key.verifier_key()], origin=ORIGIN)


def test_deleted_lines_of_a_filtered_bundle_fail_by_the_manifest(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(30)])
    ledger.export(tmp_path / "t", scope_tag="st-tenant1", renderings=False)
    entries = tmp_path / "t" / bundle.ENTRIES
    entries.write_text("".join(_lines(entries)[1:]), encoding="utf-8")
    with pytest.raises(VerificationError, match="the manifest says 10"):
        verify_bundle(tmp_path / "t", [key.verifier_key()], origin=ORIGIN)


@pytest.mark.parametrize(
    ("victim", "message"),
    [
        (bundle.CONSISTENCY, "listed in the manifest but missing"),
        (bundle.PROOFS, "30 tlog-proof files" if False else "0 tlog-proof files"),
        (manifest.MANIFEST, "bundle has no manifest"),
        (bundle.CSV, "listed in the manifest but missing"),
        (PAYLOADS, "listed in the manifest but missing"),
    ],
)
def test_deleting_a_part_of_a_bundle_fails(
    complete: Path, key: SigningKey, victim: str, message: str
) -> None:
    path = complete / victim
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    for full in (False, True):
        with pytest.raises(VerificationError, match=message):
            verify_bundle(complete, [key.verifier_key()], origin=ORIGIN, full=full)


def test_the_origin_must_be_pinned_and_a_wrong_one_is_named(
    complete: Path, key: SigningKey
) -> None:
    with pytest.raises(OriginNotPinnedError, match="pass --origin"):
        verify_bundle(complete, [key.verifier_key()])
    with pytest.raises(VerificationError, match="another log, or the wrong --origin"):
        verify_bundle(complete, [key.verifier_key()], origin="log.kvguard.test/other")
    code, out = _run("verify", str(complete), "--key", key.verifier_key())
    assert code == 2 and "pass --origin" in out
    code, out = _run("verify", str(complete), "--key", key.verifier_key(), "--origin", ORIGIN)
    assert code == 0 and f"origin {ORIGIN!r}" in out


def test_an_erasure_is_proven_offline_even_in_the_tenants_own_export(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(6)])
    kept = ledger.append(make_event(6, payload={"user": "kept"}))
    gone = ledger.append(make_event(7, payload={"user": "erased"}))  # scope tag st-tenant1
    with pytest.raises(AuditError, match="unknown erasure reason"):
        ledger.erase_payload(gone, reason="because a user asked nicely")
    ledger.erase_payload(gone, reason=ErasureReason.DATA_SUBJECT_REQUEST)
    ledger.export(tmp_path / "all")  # states only: no payload, no commitment salt (G6)
    report = verify_bundle(tmp_path / "all", [key.verifier_key()], origin=ORIGIN, full=True)
    assert (report.payloads, report.erased_payloads) == (1, 1)
    lines = [json.loads(x) for x in _lines(tmp_path / "all" / PAYLOADS)]
    assert lines[0] == {"index": kept, "state": "present"}
    assert lines[1]["state"] == "erased" and lines[1]["erased_by"] == gone + 1
    assert b"kept" not in b"".join(p.read_bytes() for p in (tmp_path / "all").iterdir())
    ledger.export(tmp_path / "own", scope_tag="st-tenant1")  # the erased entry's tenant
    own = verify_bundle(tmp_path / "own", [key.verifier_key()], origin=ORIGIN)
    assert (own.payloads, own.erased_payloads) == (0, 1)  # `kept` is st-tenant0's
    kinds = [json.loads(x)["event"]["kind"] for x in _lines(tmp_path / "own" / bundle.ENTRIES)]
    assert "payload.erase" in kinds  # the erasure entry carries the erased entry's scope tag


def test_a_payload_deleted_behind_the_logs_back_is_visible(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(4)])
    victim = ledger.append(make_event(4, payload={"user": "dana"}))
    ledger.export(tmp_path / "before")
    raw = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    raw.execute("DELETE FROM ledger_payloads WHERE idx = ?", (victim,))  # allowed: no trigger
    raw.close()
    with pytest.raises(VerificationError, match=f"entry {victim}: payload deleted without"):
        ledger.export(tmp_path / "after")
    # An exporter that hides the deletion (leaves the line out and re-signs the manifest) is
    # still caught: the commitment in the proven leaf has no line.
    payloads = tmp_path / "before" / PAYLOADS
    payloads.write_text("", encoding="utf-8")
    signed = (tmp_path / "before" / manifest.MANIFEST).read_text(encoding="utf-8")
    text = manifest.parse_manifest(signed.split("\n\n")[0] + "\n")
    files = {**text.files, PAYLOADS: manifest.file_digest(payloads)}
    forged = manifest.format_manifest(manifest.Manifest(**{**text.__dict__, "files": files}))
    (tmp_path / "before" / manifest.MANIFEST).write_text(ledger.sign_note(forged))
    with pytest.raises(VerificationError, match=r"neither its payload nor a payload\.erase"):
        verify_bundle(tmp_path / "before", [key.verifier_key()], origin=ORIGIN)


def test_verify_db_fails_on_entries_no_checkpoint_covers_past_the_age(
    open_ledger: Opener, sqlite_url: str, key: SigningKey
) -> None:
    clock = [T0 + timedelta(hours=2)]
    ledger = open_ledger(sqlite_url, clock=lambda: clock[0])
    ledger.append_many([make_event(i) for i in range(5)])  # stamped T0 + i ms
    assert ledger.verify().size == 5  # no age given: as before
    with pytest.raises(VerificationError, match=r"entries 0\.\.4 are covered by no checkpoint"):
        ledger.verify(max_unsigned_age=timedelta(hours=1))
    assert ledger.verify(max_unsigned_age=timedelta(hours=3)).size == 5
    ledger.checkpoint()
    ledger.append(make_event(5, ts=clock[0]))
    assert ledger.verify(max_unsigned_age=timedelta(hours=1)).checkpoints == 1
    clock[0] = T0 + timedelta(days=2)
    with pytest.raises(VerificationError, match=r"entries 5\.\.5"):
        ledger.verify(max_unsigned_age=timedelta(days=1))


def test_the_checkpoint_saved_is_the_one_verified_even_if_the_file_changes_after(
    signed: tuple[str, Path, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--save-checkpoint` (and the witness check) use the signed note the verification read, not
    the bundle's file read again: a bundle changed between the two (a shared directory, another
    process) must not get an unverified note pinned as the auditor's trusted checkpoint."""
    from kvguard.audit import verify_cli  # noqa: PLC0415

    url, key_file, vkey = signed
    _export(url, key_file, tmp_path / "b")
    verified = (tmp_path / "b" / bundle.CHECKPOINT).read_text()
    real = verify_cli.verify_bundle

    def then_swapped(directory: Path, *args: object, **kwargs: object) -> object:
        report = real(directory, *args, **kwargs)  # type: ignore[arg-type]
        (directory / bundle.CHECKPOINT).write_text("planted after the check\n")
        return report

    monkeypatch.setattr(verify_cli, "verify_bundle", then_swapped)
    pin = tmp_path / "pinned.checkpoint"
    code, out = _run("verify", str(tmp_path / "b"), "--key", vkey, "--origin", ORIGIN,
                     "--save-checkpoint", str(pin))  # fmt: skip
    assert code == 0, out
    assert pin.read_text() == verified
