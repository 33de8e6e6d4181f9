"""An attacker's review of `kvguard verify`, `audit export` and erasure certificates.

Each test builds a real ledger (SQLite), exports it and tampers with one copy. The tests whose
docstrings begin `FOUND` failed on the code the review ran against (what they describe is what used
to happen) and pass since the fixes; the others pin down tampers that were already refused, with a
clear message.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import shutil
import sqlite3
import tracemalloc
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from kvguard.audit import note
from kvguard.audit.certificate import load as load_certificate
from kvguard.audit.certificate import verify_certificate
from kvguard.audit.ledger import Ledger
from kvguard.audit.manifest import Manifest, file_digest, format_manifest, parse_manifest
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError

from .conftest import ORIGIN, T0, make_event

Opener = Callable[..., Ledger]


def _ledger(open_ledger: Opener, url: str, n: int = 24) -> Ledger:
    ledger = open_ledger(url)
    ledger.append_many([make_event(i) for i in range(n // 2)])
    ledger.checkpoint()
    ledger.append_many(
        [
            make_event(i, payload={"user": f"u{i}"}) if i % 5 == 0 else make_event(i)
            for i in range(n // 2, n)
        ]
    )
    return ledger


def _verify(bundle: Path, key: SigningKey, **kw: Any) -> Any:
    return verify_bundle(bundle, [key.verifier_key()], origin=ORIGIN, parallel=False, **kw)


def _resign_manifest(bundle: Path, key: SigningKey, selection: str | None = None) -> None:
    """What an exporter holding the log's key can do: sign a manifest for whatever it wrote
    (`selection`: labelled so)."""
    m = parse_manifest(note.split_note((bundle / "manifest").read_text())[0])
    files = {
        p.name: file_digest(p)
        for p in bundle.iterdir()
        if p.is_file() and p.name not in {"checkpoint", "manifest"}
    }
    lines = sum(1 for _ in (bundle / "entries.jsonl").open())
    chosen = m.selection if selection is None else selection
    text = format_manifest(Manifest(m.origin, m.size, m.root, chosen, lines, files, m.proofs))
    (bundle / "manifest").write_text(note.join_note(text, [key.signature_line(text)]))


def _drop_triggers(db: Path) -> sqlite3.Connection:
    raw = sqlite3.connect(db, isolation_level=None)
    for (name,) in raw.execute(
        "SELECT name FROM sqlite_master WHERE type='trigger' AND name LIKE 'ledger_%'"
    ).fetchall():
        raw.execute(f"DROP TRIGGER {name}")
    return raw


# --- what works: tampers refused with a specific message ------------------------------------


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        (
            "delete a line",
            lambda b: _edit_lines(b, lambda ls: ls[:3] + ls[4:]),
            "a complete bundle holds entry 3 here",
        ),
        (
            "swap two lines",
            lambda b: _edit_lines(b, lambda ls: [*ls[:3], ls[4], ls[3], *ls[5:]]),
            "a complete bundle holds entry 3 here",
        ),
        (
            "duplicate a line",
            lambda b: _edit_lines(b, lambda ls: ls[:4] + ls[3:]),
            "index is not an integer above the previous one",
        ),
        (
            "drop the tail",
            lambda b: _edit_lines(b, lambda ls: ls[:-3]),
            "lines deleted at the end",
        ),
        ("a link inside the bundle", lambda b: _link(b, "entries.jsonl"), "unexpected link"),
        (
            "deep nesting",
            lambda b: _edit_lines(b, lambda ls: ["[" * 100_000 + "]" * 100_000 + "\n", *ls[1:]]),
            "not an entry line",
        ),
        (
            "an over-long index",
            lambda b: _edit_lines(
                b, lambda ls: [ls[0].replace('"index":0', '"index":' + "9" * 5000), *ls[1:]]
            ),
            "not an entry line",
        ),
    ],
)
def test_entry_tampers_are_refused(
    name: str,
    change: Callable[[Path], None],
    message: str,
    sqlite_url: str,
    open_ledger: Opener,
    key: SigningKey,
    tmp_path: Path,
) -> None:
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b")
    _verify(tmp_path / "b", key)  # control
    change(tmp_path / "b")
    with pytest.raises(VerificationError, match=message):
        _verify(tmp_path / "b", key)


def _edit_lines(bundle: Path, edit: Callable[[list[str]], list[str]]) -> None:
    path = bundle / "entries.jsonl"
    path.write_text("".join(edit(path.read_text().splitlines(keepends=True))))


def _link(bundle: Path, name: str) -> None:
    target = bundle.parent / f"outside-{name}"
    shutil.move(bundle / name, target)
    os.symlink(target, bundle / name)


def test_forked_checkpoint_is_refused_against_a_kept_one(
    tmp_path: Path, open_ledger: Opener, key: SigningKey
) -> None:
    """Two ledgers with the same key and origin, equal for 12 entries, then different: the
    auditor who kept the first one's checkpoint refuses the other's bundle."""
    first = _ledger(open_ledger, f"sqlite:///{tmp_path / 'a.db'}")
    kept = first.checkpoint()
    fork = open_ledger(f"sqlite:///{tmp_path / 'b.db'}")
    fork.append_many([make_event(i) for i in range(12)])
    fork.checkpoint()
    fork.append_many([make_event(i, request_id="forked") for i in range(12, 24)])
    fork.export(tmp_path / "fork")
    with pytest.raises(VerificationError, match="same size, different root"):
        _verify(tmp_path / "fork", key, trusted_checkpoint=kept)


# --- FINDING 1 (medium): `--full` reads a hostile entries.jsonl without bounds ---------------


def test_full_refuses_an_overlong_line_like_the_plain_path(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: without --full a line over 16 MiB is refused at once; with --full
    (`offline_full._line_blocks`) the partial line is carried and re-copied every 256 KiB, so
    time grows with the square of the line (32 MiB: 3 s, 128 MiB: 42 s, 1 GiB: ~45 min) and
    memory with the line, before any check."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b")
    (tmp_path / "b" / "entries.jsonl").write_bytes(b"a" * ((16 << 20) + 2))
    with pytest.raises(VerificationError, match="line longer than"):
        _verify(tmp_path / "b", key)  # control: the plain path names it
    with pytest.raises(VerificationError, match="line longer than"):
        _verify(tmp_path / "b", key, full=True)


def test_full_does_not_hold_more_lines_than_the_checkpoint_has(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: the signed checkpoint (and manifest) say 24 entries, yet --full hashes and keeps
    every line of entries.jsonl before comparing counts: about 200 bytes of memory per line
    (10 MiB of newlines took 2.1 GB RSS), so a bundle of a few hundred MB exhausts memory."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b")
    (tmp_path / "b" / "entries.jsonl").write_bytes(b"\n" * 2_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(VerificationError):
            _verify(tmp_path / "b", key, full=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One block of lines at a time (256 KiB of one-byte lines is the worst case), not ~200 bytes
    # per line of the file (2,000,000 lines held ~400 MB before).
    assert peak < 40 << 20, f"peak {peak >> 20} MiB for a 24-entry checkpoint"


# --- FINDING 2 (medium): a filtered export hides an entry whose query column was edited ------


@pytest.mark.parametrize(
    ("column", "value", "filters"),
    [
        ("scope_tag", "st-elsewhere", {"scope_tag": "st-tenant0"}),
        ("scope_tag", None, {"scope_tag": "st-tenant0"}),
        ("ts_us", 0, {"since": T0, "until": T0 + timedelta(hours=1)}),
    ],
)
def test_filtered_export_refuses_a_row_edited_out_of_its_filter(
    column: str,
    value: object,
    filters: dict[str, Any],
    sqlite_url: str,
    open_ledger: Opener,
    key: SigningKey,
    tmp_path: Path,
) -> None:
    """FOUND: docs/audit.md says the exporter refuses rows whose query columns disagree with
    their leaves, "which is how an entry could be hidden from a filter". `export._rows` checks
    only the rows the filter selects: a row whose column was moved *out* of the filter is never
    read, so the tenant's (or time range's) export silently leaves it out, the manifest signs
    the shorter selection and `kvguard verify` says valid."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "before", **filters)
    before = _verify(tmp_path / "before", key).entries
    hidden = 3  # st-tenant0, inside the time range
    db = Path(sqlite_url.removeprefix("sqlite:///"))
    raw = _drop_triggers(db)
    raw.execute(f"UPDATE ledger_entries SET {column} = ? WHERE idx = ?", (value, hidden))
    raw.close()
    with pytest.raises(VerificationError):
        ledger.export(tmp_path / "after", **filters)
        after = _verify(tmp_path / "after", key).entries
        raise AssertionError(f"exported {after} of {before} entries, entry {hidden} hidden")


# --- FINDING 3 (low): tlog-proof files may carry an `extra` line nobody signed ----------------


def test_tlog_proof_with_an_added_extra_line_is_refused(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: proofs/ is counted by the manifest but its files are not digested, and
    `parse_tlog_proof` accepts an optional `extra` line: anyone can add data to a proof file
    and the bundle still verifies (kvguard never writes `extra`)."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b", tlog_proofs=True)
    proof = tmp_path / "b" / "proofs" / "3.tlog-proof"
    head, rest = proof.read_text().split("\n", 1)
    proof.write_text(f"{head}\nextra {base64.b64encode(b'smuggled').decode()}\n{rest}")
    with pytest.raises(VerificationError):
        _verify(tmp_path / "b", key)


# --- FINDING 4 (low): a filtered bundle's entries are not held to its signed selection --------


def test_entries_outside_the_signed_selection_are_refused(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: the manifest says `filtered {"scope_tag":"st-tenant1"}` and `kvguard verify`
    prints it, but nothing checks that the entries carry that tag (nor `since`/`until`): an
    exporter can put another tenant's entries in a tenant's bundle and it verifies."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "t1", scope_tag="st-tenant1")
    ledger.export(tmp_path / "t0", scope_tag="st-tenant0", renderings=False)
    b = tmp_path / "t1"
    lines = {json.loads(x)["index"]: x for x in (b / "entries.jsonl").open()}
    lines.update({json.loads(x)["index"]: x for x in (tmp_path / "t0" / "entries.jsonl").open()})
    (b / "entries.jsonl").write_text("".join(lines[i] for i in sorted(lines)))
    (b / "entries.csv").unlink()
    (b / "entries.ocsf.jsonl").unlink()
    shutil.copy(tmp_path / "t0" / "payloads.jsonl", b / "payloads.jsonl")
    committed = sorted(json.loads(x)["index"] for x in (tmp_path / "t0" / "payloads.jsonl").open())
    assert not any(json.loads(lines[i])["event"]["scope_tag"] == "st-tenant1" for i in committed)
    _resign_manifest(b, key)
    with pytest.raises(VerificationError):
        report = _verify(b, key)
        raise AssertionError(f"valid: {report.entries} entries, selection {report.selection}")


def test_full_verification_holds_a_filtered_bundle_to_its_selection(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """Found by a review: `--full` skipped the selection check, so a complete export with its
    manifest re-signed as one tenant's (`filtered {"scope_tag":"st-tenant1"}`) verified under
    `--full` while the plain path refused it."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b")
    _resign_manifest(tmp_path / "b", key, selection='filtered {"scope_tag":"st-tenant1"}')
    for full in (False, True):
        with pytest.raises(VerificationError, match="outside the manifest's selection"):
            report = _verify(tmp_path / "b", key, full=full)
            raise AssertionError(f"full={full}: valid, {report.entries} entries")


def test_a_filtered_bundle_carries_no_foreign_entry(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """Found by a review: a foreign line (`"event":null`, bytes that are no kvguard event) in a
    tenant's filtered bundle verified with a warning; filtered exports never carry one, so
    arbitrary bytes rode along in one tenant's bundle."""
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(4)])
    with ledger.store.engine.begin() as conn:
        leaf = b"raw prompt text: secret"
        conn.exec_driver_sql(
            "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
            "SELECT size, ?, ?, 'block.alloc', 0 FROM ledger_head",
            (leaf, hashlib.sha256(b"\x00" + leaf).digest()),
        )
    ledger.append_many([make_event(i) for i in range(5, 8)])
    ledger.export(tmp_path / "all", renderings=False)
    ledger.export(tmp_path / "t1", scope_tag="st-tenant1", renderings=False)
    b = tmp_path / "t1"
    lines = {json.loads(x)["index"]: x for x in (b / "entries.jsonl").open()}
    (foreign,) = [x for x in (tmp_path / "all" / "entries.jsonl").open() if '"event":null' in x]
    lines[json.loads(foreign)["index"]] = foreign
    (b / "entries.jsonl").write_text("".join(lines[i] for i in sorted(lines)))
    _resign_manifest(b, key)
    with pytest.raises(VerificationError, match="a foreign entry in a filtered bundle"):
        _verify(b, key)
    with pytest.raises(VerificationError):  # --full: not the complete log either
        _verify(b, key, full=True)


def test_an_old_checkpoint_of_the_wrong_type_is_named_not_a_python_error(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """Found by a review: `"old_checkpoint": ["a"]` in consistency.jsonl raised AttributeError
    (a traceback from `kvguard verify`), and no key is needed to write it."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.checkpoint()
    ledger.export(tmp_path / "b")
    path = tmp_path / "b" / "consistency.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    for wrong in (["a"], {"a": 1}, 7):
        obj = json.loads(lines[0])
        obj["old_checkpoint"] = wrong
        path.write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n")
        with pytest.raises(VerificationError, match=r"consistency\.jsonl line 1: old_checkpoint"):
            _verify(tmp_path / "b", key)


# --- FINDING 5 (low): unclear or misattributed error messages -----------------------------


def test_non_utf8_names_the_file(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: docs/audit.md promises malformed input names the file; non-UTF-8 bytes in
    entries.jsonl (or payloads, consistency, renderings) give "a bundle file is not valid UTF-8"."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b")
    path = tmp_path / "b" / "entries.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"note":"n5"', b'"note":"n\xff"', 1))
    with pytest.raises(VerificationError, match=r"entries\.jsonl"):
        _verify(tmp_path / "b", key)


@pytest.mark.parametrize(
    ("name", "line"), [("payloads.jsonl", "[10]\n"), ("consistency.jsonl", "[]\n")]
)
def test_a_line_of_the_wrong_shape_is_named_not_a_python_error(
    name: str, line: str, sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: a JSON array where an object belongs yields "'list' object has no attribute
    'get'" / "list indices must be integers or slices, not str" (Python internals)."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b")
    path = tmp_path / "b" / name
    rest = path.read_text().splitlines(keepends=True)[1:]
    path.write_text(line + "".join(rest))
    with pytest.raises(VerificationError) as caught:
        _verify(tmp_path / "b", key)
    message = str(caught.value)
    assert message.startswith(f"{name} line 1: not a "), message
    assert "has no attribute" not in message and "list indices" not in message, message


def test_a_tampered_entries_file_is_blamed_not_the_rendering(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: a line deleted from a filtered bundle's entries.jsonl is reported as
    "entries.csv (entry N): differs from the proven leaf": the signed digests, which name the
    changed file exactly, are compared last (`offline._check_digests`)."""
    ledger = _ledger(open_ledger, sqlite_url)
    ledger.export(tmp_path / "b", scope_tag="st-tenant1")
    _edit_lines(tmp_path / "b", lambda ls: ls[:2] + ls[3:])
    with pytest.raises(VerificationError, match=r"^entries\.jsonl"):
        _verify(tmp_path / "b", key)


# --- FINDING 6 (low): erasure certificates ------------------------------------------------


def test_certificate_with_duplicate_keys_is_refused(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: `certificate.load` keeps the last of duplicate keys, so a document whose first
    `cleared` says 99 verifies; a relying party whose JSON reader keeps the first reads 99."""
    from tests.audit.test_auditor_edges import _certificate, _purge_log  # noqa: PLC0415

    doc = _certificate(_purge_log(open_ledger, sqlite_url), [0, 1, 2, 3, 4])
    verify_certificate(copy.deepcopy(doc), [key.verifier_key()])  # control
    text = json.dumps(doc)
    text = text.replace('"engines": [', '"engines": "all of them", "engines": [', 1)
    path = tmp_path / "cert.json"
    path.write_text(text)
    with pytest.raises(VerificationError):
        verify_certificate(load_certificate(path), [key.verifier_key()])


def test_certificate_id_must_name_its_job_and_checkpoint(
    sqlite_url: str, open_ledger: Opener, key: SigningKey
) -> None:
    """FOUND: docs/api.md defines `certificate_id` as `<origin>/purges/<job>/certificate@<tree
    size>`, but the verifier never reads it: a certificate of job 7 relabelled as job 99's
    verifies."""
    from tests.audit.test_auditor_edges import _certificate, _purge_log  # noqa: PLC0415

    doc = _certificate(_purge_log(open_ledger, sqlite_url), [0, 1, 2, 3, 4])
    size = doc["evidence"]["tree_size"]
    doc["certificate_id"] = f"{ORIGIN}/purges/7/certificate@{size}"
    verify_certificate(copy.deepcopy(doc), [key.verifier_key()])  # control
    doc["certificate_id"] = f"{ORIGIN}/purges/99/certificate@{size}"
    with pytest.raises(VerificationError):
        verify_certificate(doc, [key.verifier_key()])


# --- FINDING 7 (low): one app-role INSERT at the head stops checkpoints until an append ------


def test_checkpoint_after_a_row_inserted_at_the_head(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    """FOUND: docs/audit.md: "no single INSERT or UPDATE by the app role can stop later appends
    or reads"; a row inserted at the head (triggers on) that completes a subtree leaves its
    stored hash missing, and `checkpoint()` / `export` refuse with "stored hash of subtree
    (1, 12) is missing" until some later append rebuilds it."""
    ledger = _ledger(open_ledger, sqlite_url, n=25)
    ledger.checkpoint()
    ledger.close()
    db = Path(sqlite_url.removeprefix("sqlite:///"))
    raw = sqlite3.connect(db, isolation_level=None)
    leaf = b"not an event"
    import hashlib  # noqa: PLC0415

    raw.execute(
        "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) VALUES (25, ?, ?, 'x', 0)",
        (leaf, hashlib.sha256(b"\x00" + leaf).digest()),
    )
    raw.close()
    reopened = open_ledger(sqlite_url)
    reopened.checkpoint()
    # and the proofs the API and witnesses read (a re-test found them still stopped)
    assert reopened.inclusion_proof(3, 26) and reopened.consistency_proof(12, 26)
    reopened.export(tmp_path / "b")
    assert _verify(tmp_path / "b", key).foreign == (25,)
