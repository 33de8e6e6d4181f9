"""Attacks on the foreign-leaf change (6cf8fa2) by an independent review (thirteenth session):
`bundle.is_event` / `leaf_event` decide what is an event; foreign leaves are exported as
`"event":null`, skipped by filtered exports and listings, and proven (with a warning) by the
offline verifier.

Attackers: the app role holding INSERT on `ledger_entries` (appends a row at the head with a correct
leaf hash and index columns of its choosing), a dishonest exporter holding the signing key (rewrites
`entries.jsonl` and re-signs the manifest), and an auditor who must not be fooled.

Faults found, each fixed (the event pattern now admits only what kvguard's event model and encoder
can write; a complete export no longer checks index columns; the plain verifier requires an
embedded leaf to be an event; `payloads.erased_index` reads events only), each test failing on the
code of 6cf8fa2:

- an integer of more than 4,300 digits: `is_event` said event, `json.loads` refused it, so the
  streamed export embedded it and plain verification failed while `--full` passed; listings 500;
- `1e400` / `1.8e+308` in details (parse to infinity): OCSF held `Infinity`, not JSON;
- a lone surrogate escape (`"\\ud800"`): listings 500;
- a CR/LF (escaped in the leaf) in `kind` / `request_id`: the CSV rendering held it raw and every
  later complete export with renderings failed verification;
- an escaped but equal `scope_tag` (`"st\\u002dtenant0"`): the tenant's streamed export stopped for
  good, while the directory export included the entry;
- a well-formed event whose index columns disagree: stopped every complete directory export;
- a dishonest exporter embedding a foreign JSON leaf as an event: accepted, the warning gone (plain
  verification now refuses; `--full` refuses since the sixteenth session);
- a key-injecting leaf embedded as an event: plain and `--full` verification disagreed;
- a foreign leaf standing as the `payload.erase` proof of a payload deleted from its table.

Held from the start: U+2028, `\\u0000`, duplicate detail keys, `-0`, non-ASCII in details; the
leaves kvguard writes (floats, escapes, old and new timestamps) are events; an event carried as
foreign with its payload line dropped is refused; foreign leaves `null`, empty, NUL bytes with tlog
proofs, payloads and consistency; filtered exports by tag and time; the parallel `--full` path with
a foreign line at the split; no catastrophic backtracking on crafted 1 MB leaves.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvguard.api.audit_schemas import EntryPage, EntryPublic
from kvguard.audit import bundle, manifest, merkle, offline_full
from kvguard.audit.bundle_stream import BundleStream, ExportQuery
from kvguard.audit.leaf import prepare_entry, ts_micros
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError

from .conftest import ORIGIN, T0, make_event, unpack_stream

Opener = Callable[..., Ledger]

_AT_HEAD = (
    "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, scope_tag, request_id, ts_us) "
    "SELECT size, ?, ?, ?, ?, ?, ? FROM ledger_head"
)
_T0_US = ts_micros(T0)


def _leaf(
    *,
    block_ids: bytes = b"[]",
    details: bytes = b"{}",
    kind: bytes = b'"block.alloc"',
    request_id: bytes = b"null",
    scope_tag: bytes = b"null",
    ts: bytes = b"2026-11-26T12:00:00.000000",
) -> bytes:
    """A hand-made leaf in the byte layout of a version-1 event."""
    return (
        b'{"block_ids":'
        + block_ids
        + b',"details":'
        + details
        + b',"kind":'
        + kind
        + b',"payload_commitment":null,"request_id":'
        + request_id
        + b',"scope_tag":'
        + scope_tag
        + b',"ts":"'
        + ts
        + b'Z","v":1}'
    )


def _insert(
    ledger: Ledger,
    leaf: bytes,
    kind: str = "block.alloc",
    scope_tag: str | None = None,
    request_id: str | None = None,
    ts_us: int = _T0_US,
) -> None:
    """The app role's INSERT at the head: correct leaf hash, columns of the attacker's choosing."""
    digest = hashlib.sha256(b"\x00" + leaf).digest()
    with ledger.store.engine.begin() as conn:
        conn.exec_driver_sql(_AT_HEAD, (leaf, digest, kind, scope_tag, request_id, ts_us))


def _log_with(ledger: Ledger, leaf: bytes, **columns: Any) -> int:
    """Events 0-5, the inserted row at 6, events 7-9."""
    ledger.append_many([make_event(i) for i in range(6)])
    _insert(ledger, leaf, **columns)
    ledger.append_many([make_event(i) for i in range(7, 10)])
    return 6


def _verify(path: Path, key: SigningKey, *, full: bool = False) -> Any:
    return verify_bundle(path, [key.verifier_key()], origin=ORIGIN, full=full)


def _resign(ledger: Ledger, out: Path) -> None:
    """The dishonest exporter's last step: the manifest names the edited files' digests again."""
    signed = (out / manifest.MANIFEST).read_text(encoding="utf-8")
    text = manifest.parse_manifest(signed.split("\n\n")[0] + "\n")
    files = {name: manifest.file_digest(out / name) for name in text.files}
    forged = manifest.format_manifest(manifest.Manifest(**{**text.__dict__, "files": files}))
    (out / manifest.MANIFEST).write_text(ledger.sign_note(forged))


def _rewrite_line(out: Path, number: int, line: str) -> None:
    path = out / bundle.ENTRIES
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[number] = line
    path.write_text("".join(lines), encoding="utf-8")


def _listing_status(ledger: Ledger) -> int:
    """GET a listing page the way the API answers it (response model EntryPage)."""
    app = FastAPI()

    @app.get("/entries", response_model=EntryPage)
    def entries() -> EntryPage:
        page = ledger.query(limit=100)
        return EntryPage(entries=[EntryPublic.of(r) for r in page.records], next_cursor=None)

    with TestClient(app, raise_server_exceptions=False) as client:
        return client.get("/entries").status_code


def _listing_body(ledger: Ledger) -> Any:
    page = ledger.query(limit=100)
    app = FastAPI()

    @app.get("/entries", response_model=EntryPage)
    def entries() -> EntryPage:
        return EntryPage(entries=[EntryPublic.of(r) for r in page.records], next_cursor=None)

    with TestClient(app) as client:
        return client.get("/entries").json()


# ---------------------------------------------------------------------------------------------
# An integer of more than 4,300 digits: is_event and leaf_event disagree


_HUGE = _leaf(block_ids=b"[" + b"1" * 5000 + b"]")


def test_huge_integer_is_one_decision() -> None:
    """Fixed: integers are bounded at 640 digits (every Python parses them; the model refuses
    longer): the leaf is foreign to every reader."""
    assert not bundle.is_event(_HUGE)
    assert bundle.leaf_event(_HUGE) is None


def test_huge_integer_streamed_complete_export_verifies(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, _HUGE)
    unpacked = unpack_stream(BundleStream(ledger, ExportQuery()), tmp_path / "tar")
    full = _verify(unpacked, key, full=True)  # passes today: no JSON parsing in --full
    plain = _verify(unpacked, key)  # fails today
    assert plain.foreign == full.foreign
    ledger.export(tmp_path / "plain", renderings=False)
    assert (unpacked / bundle.ENTRIES).read_bytes() == (
        tmp_path / "plain" / bundle.ENTRIES
    ).read_bytes()


def test_huge_integer_listing(open_ledger: Opener, sqlite_url: str) -> None:
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, _HUGE)
    assert _listing_status(ledger) == 200


# ---------------------------------------------------------------------------------------------
# Numbers and strings that parse, but cannot be served or rendered


_INF = _leaf(details=b'{"x":1e400}')
_INF_SIGNED = _leaf(details=b'{"x":1.8e+308}')
_SURROGATE = _leaf(details=b'{"x":"\\ud800"}')


def test_lone_surrogate_event_listing(open_ledger: Opener, sqlite_url: str) -> None:
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, _SURROGATE)
    assert _listing_status(ledger) == 200


@pytest.mark.parametrize("leaf", [_INF, _INF_SIGNED], ids=["1e400", "1e+400"])
def test_an_infinite_detail_is_foreign_and_listings_go_on(
    open_ledger: Opener, sqlite_url: str, leaf: bytes
) -> None:
    """Fixed: a float `repr` cannot write (no exponent sign, or an exponent that overflows) makes
    the leaf foreign; listings skip it."""
    assert not bundle.is_event(leaf)
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, leaf)
    assert _listing_status(ledger) == 200
    assert 6 not in [e["index"] for e in _listing_body(ledger)["entries"]]


def test_inf_detail_ocsf_rendering_is_json(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, _INF)
    ledger.export(tmp_path / "b")
    assert _verify(tmp_path / "b", key).foreign == (6,)  # fixed: foreign, so never rendered

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    for line in (tmp_path / "b" / bundle.OCSF).read_text(encoding="utf-8").splitlines():
        json.loads(line, parse_constant=refuse)


# ---------------------------------------------------------------------------------------------
# CR / LF in a rendered string field


@pytest.mark.parametrize(
    ("leaf", "columns"),
    [
        (_leaf(kind=b'"a\\nb"'), {"kind": "a\nb"}),
        (_leaf(request_id=b'"a\\rb"'), {"request_id": "a\rb"}),
    ],
    ids=["LF-in-kind", "CR-in-request_id"],
)
def test_newline_in_rendered_field_does_not_break_verification(
    open_ledger: Opener,
    sqlite_url: str,
    key: SigningKey,
    tmp_path: Path,
    leaf: bytes,
    columns: dict[str, str],
) -> None:
    assert not bundle.is_event(leaf)  # fixed: kinds are lower-case words, request ids ASCII
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, leaf, **columns)
    ledger.export(tmp_path / "b")  # the default: with renderings
    for full in (False, True):
        assert _verify(tmp_path / "b", key, full=full).foreign == (6,)


# ---------------------------------------------------------------------------------------------
# Index columns


def test_doctored_columns_do_not_stop_complete_export(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    leaf = prepare_entry(make_event(6)).leaf  # block.release of st-tenant0 ...
    _log_with(ledger, leaf, kind="block.alloc", scope_tag=None, request_id=None, ts_us=0)
    # the streamed complete export does not look at the columns: it goes on
    _verify(unpack_stream(BundleStream(ledger, ExportQuery()), tmp_path / "tar"), key, full=True)
    ledger.export(tmp_path / "b")  # raises today
    _verify(tmp_path / "b", key, full=True)


def _escaped_tag_log(ledger: Ledger) -> None:
    event = make_event(6)  # st-tenant0
    leaf = prepare_entry(event).leaf.replace(b'"st-tenant0"', b'"st\\u002dtenant0"')
    assert not bundle.is_event(leaf)  # fixed: a tag is printable ASCII, escaped only as JSON must
    ledger.append_many([make_event(i) for i in range(6)])
    _insert(ledger, leaf, str(event.kind), event.scope_tag, event.request_id, ts_micros(event.ts))
    ledger.append_many([make_event(i) for i in range(7, 10)])


def test_escaped_scope_tag_does_not_stop_tenant_stream(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    _escaped_tag_log(ledger)
    summary = ledger.export(tmp_path / "b", scope_tag="st-tenant0", renderings=False)
    assert summary.entries == 3  # 0, 3, 9: the foreign row is left out by both exporters
    unpacked = unpack_stream(
        BundleStream(ledger, ExportQuery(scope_tags=["st-tenant0"])), tmp_path / "t"
    )  # raises today
    assert (unpacked / bundle.ENTRIES).read_bytes() == (
        tmp_path / "b" / bundle.ENTRIES
    ).read_bytes()


# ---------------------------------------------------------------------------------------------
# Odd but harmless leaves: every reader agrees


# Not events since the pattern admits only what kvguard's model allows (kinds are lower-case words,
# tags printable ASCII): foreign, and every reader agrees on that too.
_ODD_FOREIGN = {
    "u2028-in-kind": (_leaf(kind='"a\u2028b"'.encode()), {"kind": "a\u2028b"}),
    "nel-in-scope": (_leaf(scope_tag='"t\u0085x"'.encode()), {"scope_tag": "t\u0085x"}),
    "nul-escape": (_leaf(kind=b'"a\\u0000b"'), {"kind": "a\x00b"}),
}
_ODD = {
    "nul-escape-in-details": (_leaf(details=b'{"a":"x\\u0000y"}'), {}),
    "u2028-in-details": (_leaf(details='{"a":"x\u2028y"}'.encode()), {}),
    "duplicate-detail-keys": (_leaf(details=b'{"a":1,"a":2}'), {}),
    "minus-zero-and-negative-ids": (_leaf(block_ids=b"[-0,-5]"), {}),
    "non-ascii": (_leaf(details='{"é":"😀"}'.encode()), {}),
    "payload-key-in-details": (
        _leaf(details=b'{"payload_commitment":"' + b"a" * 64 + b'","leaf":"x"}'),
        {},
    ),
}


@pytest.mark.parametrize("name", list(_ODD))
def test_odd_events_agree_everywhere(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path, name: str
) -> None:
    leaf, columns = _ODD[name]
    assert bundle.is_event(leaf) and bundle.leaf_event(leaf) is not None
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, leaf, **columns)
    ledger.export(tmp_path / "b", tlog_proofs=True)
    for full in (False, True):
        report = _verify(tmp_path / "b", key, full=full)
        assert (report.entries, report.foreign, report.payloads) == (10, (), 0)
    line = json.loads((tmp_path / "b" / bundle.ENTRIES).read_bytes().splitlines()[6])
    assert line["event"] == bundle.leaf_event(leaf)
    unpacked = unpack_stream(BundleStream(ledger, ExportQuery()), tmp_path / "tar")
    assert _verify(unpacked, key).foreign == ()
    ledger.export(tmp_path / "plain", renderings=False)
    assert (unpacked / bundle.ENTRIES).read_bytes() == (
        tmp_path / "plain" / bundle.ENTRIES
    ).read_bytes()
    assert _listing_status(ledger) == 200


@pytest.mark.parametrize("name", list(_ODD_FOREIGN))
def test_odd_foreign_leaves_agree_everywhere(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path, name: str
) -> None:
    leaf, columns = _ODD_FOREIGN[name]
    assert not bundle.is_event(leaf) and bundle.leaf_event(leaf) is None
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, leaf, **columns)
    ledger.export(tmp_path / "b", tlog_proofs=True)
    for full in (False, True):
        report = _verify(tmp_path / "b", key, full=full)
        assert (report.entries, report.foreign) == (10, (6,))
    unpacked = unpack_stream(BundleStream(ledger, ExportQuery()), tmp_path / "tar")
    assert _verify(unpacked, key, full=True).foreign == (6,)
    assert _listing_status(ledger) == 200


@pytest.mark.parametrize(
    "overrides",
    [
        {"details": {"f": 1e300, "g": 5e-324, "h": -0.0, "i": 1e16, "j": 2**70}},
        {"details": {"q": 'a"b\\c\n\t\x01\x7f\u2028é😀'}},
        {"ts": datetime(1, 1, 1, tzinfo=UTC)},
        {"ts": datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)},
        {"ts": datetime(1969, 12, 31, 23, 59, 59, 1, tzinfo=UTC)},
        {"request_id": '"\\{}', "scope_tag": "~!"},
        {"block_ids": [], "details": {}, "request_id": None, "scope_tag": None},
        {"payload": {"user": "carol"}},
    ],
)
def test_leaves_kvguard_writes_are_events(overrides: dict[str, Any]) -> None:
    leaf = prepare_entry(make_event(2, **overrides)).leaf
    assert bundle.is_event(leaf), leaf
    assert bundle.leaf_event(leaf) == json.loads(leaf)


# ---------------------------------------------------------------------------------------------
# The dishonest exporter


def _embed_foreign(ledger: Ledger, out: Path, leaf: bytes, index: int) -> None:
    """Rewrite the foreign entry's line as if the leaf were an event, re-sign the manifest."""
    old = json.loads((out / bundle.ENTRIES).read_bytes().splitlines()[index])
    assert old["event"] is None
    _rewrite_line(out, index, bundle.entry_line(index, leaf, old["inclusion_proof"]))
    _resign(ledger, out)


@pytest.mark.parametrize("full", [False, True], ids=["plain", "full"])
def test_exporter_cannot_pass_a_foreign_leaf_off_as_an_event(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path, full: bool
) -> None:
    ledger = open_ledger(sqlite_url)
    leaf = prepare_entry(make_event(6)).leaf.replace(b',"kind"', b', "kind"')  # one space
    assert not bundle.is_event(leaf)
    index = _log_with(ledger, leaf)
    out = tmp_path / "b"
    ledger.export(out, renderings=False)  # streamed exports never carry renderings either
    assert _verify(out, key).foreign == (index,)
    _embed_foreign(ledger, out, leaf, index)
    try:
        report = _verify(out, key, full=full)
    except VerificationError:
        return
    assert report.foreign == (index,), "the foreign entry went unreported"


def test_plain_and_full_agree_on_a_key_injecting_leaf(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    leaf = b'null,"inclusion_proof":["x"],"event":{}'
    index = _log_with(ledger, leaf)
    out = tmp_path / "b"
    ledger.export(out, renderings=False)
    _embed_foreign(ledger, out, leaf, index)
    outcomes = []
    for full in (False, True):
        try:
            outcomes.append(("ok", _verify(out, key, full=full).foreign))
        except VerificationError:
            outcomes.append(("refused", None))
    assert outcomes[0] == outcomes[1], outcomes


def test_exporter_cannot_carry_a_committed_event_as_foreign(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    """Hiding an event with a payload commitment as foreign, and dropping its payloads.jsonl line
    so the commitment count still matches: refused in both modes."""
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i, payload={"user": f"u{i}"}) for i in range(4)])
    out = tmp_path / "b"
    ledger.export(out, renderings=False)
    victim = json.loads((out / bundle.ENTRIES).read_bytes().splitlines()[2])
    leaf = base64.b64decode(victim["leaf"])
    _rewrite_line(out, 2, bundle.entry_line(2, leaf, victim["inclusion_proof"], foreign=True))
    payload_path = out / "payloads.jsonl"
    kept = [x for x in payload_path.read_text().splitlines(keepends=True) if '"index":2,' not in x]
    payload_path.write_text("".join(kept))
    _resign(ledger, out)
    for full in (False, True):
        with pytest.raises(VerificationError, match="carried as a foreign entry"):
            _verify(out, key, full=full)


def test_a_foreign_leaf_does_not_prove_an_erasure(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i, payload={"user": f"u{i}"}) for i in range(3)])
    forged = b'{"kind": "payload.erase", "details": {"erased_index": 1}}'
    assert not bundle.is_event(forged)
    _insert(ledger, forged, kind="payload.erase")
    with ledger.store.engine.begin() as conn:  # the app role holds DELETE on ledger_payloads
        conn.exec_driver_sql("DELETE FROM ledger_payloads WHERE idx = 1")
    ledger.append_many([make_event(5)])
    try:
        ledger.export(tmp_path / "b")
    except VerificationError:
        return  # refusing to export is an acceptable answer
    with pytest.raises(VerificationError):
        _verify(tmp_path / "b", key)


# ---------------------------------------------------------------------------------------------
# Foreign leaves with every optional bundle part


@pytest.mark.parametrize("leaf", [b"null", b"", b"\x00" * 5, b"[1,2]"], ids=repr)
def test_foreign_leaf_with_proofs_payloads_and_consistency(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path, leaf: bytes
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i, payload={"user": f"u{i}"}) for i in range(3)])
    ledger.checkpoint()
    _insert(ledger, leaf)
    ledger.append_many([make_event(i, payload={"user": f"u{i}"}) for i in range(4, 7)])
    ledger.erase_payload(5, reason="data_subject_request")
    ledger.checkpoint()
    ledger.append_many([make_event(8)])
    out = tmp_path / "b"
    ledger.export(out, tlog_proofs=True)
    lines = (out / bundle.ENTRIES).read_bytes().splitlines()
    assert json.loads(lines[3])["event"] is None
    assert (out / bundle.CONSISTENCY).read_text().count("\n") >= 1
    assert len(list((out / bundle.PROOFS).iterdir())) == len(lines)
    for full in (False, True):
        report = _verify(out, key, full=full)
        assert report.foreign == (3,)
        assert report.tlog_proofs == len(lines)
        assert report.payloads + report.erased_payloads == 6
    stream = BundleStream(ledger, ExportQuery())
    unpacked = unpack_stream(
        stream, tmp_path / "tar"
    )  # sizing and writing passes agree, or it raises
    assert _verify(unpacked, key, full=True).foreign == (3,)
    plain = tmp_path / "plain"
    ledger.export(plain, renderings=False)
    assert (unpacked / bundle.ENTRIES).read_bytes() == (plain / bundle.ENTRIES).read_bytes()


def test_filtered_exports_leave_out_a_foreign_row_whose_columns_match(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    _log_with(ledger, b"not an event", scope_tag="st-tenant0", ts_us=_T0_US + 6_000)
    since, until = T0, T0 + timedelta(seconds=1)
    for name, cli, query in [
        ("tag", {"scope_tag": "st-tenant0"}, ExportQuery(scope_tags=["st-tenant0"])),
        ("time", {"since": since, "until": until}, ExportQuery(since=since, until=until)),
    ]:
        out = tmp_path / name
        ledger.export(out, renderings=False, **cli)
        indices = [json.loads(x)["index"] for x in (out / bundle.ENTRIES).read_bytes().split()]
        assert 6 not in indices and indices
        assert _verify(out, key).foreign == ()
        unpacked = unpack_stream(BundleStream(ledger, query), tmp_path / f"t-{name}")
        assert (unpacked / bundle.ENTRIES).read_bytes() == (out / bundle.ENTRIES).read_bytes()


# ---------------------------------------------------------------------------------------------
# The parallel --full path with a foreign line at the split


_NOTE = "x" * 180  # longer lines: fewer entries to pass the 8 MiB parallel threshold


def _big_event(i: int) -> Any:
    return make_event(i, details={"blocks": 2, "note": _NOTE})


def _split_line(sizes: list[int]) -> int:
    """The line holding the middle byte (offline_full.split: part 2 starts after it)."""
    middle, at = sum(sizes) // 2, 0
    for number, size in enumerate(sizes):
        at += size
        if at > middle:
            return number
    raise AssertionError


@pytest.mark.parametrize("side", ["last-of-first-part", "first-of-second-part"])
def test_parallel_full_with_a_foreign_line_at_the_split(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path, side: str
) -> None:
    foreign = b"\xff not an event " * 20
    n = 8_500
    leaf_sizes = [len(prepare_entry(_big_event(i)).leaf) for i in range(n)]

    def sizes_with(k: int) -> list[int]:
        return [
            bundle.entry_line_size(
                i,
                len(foreign) if i == k else leaf_sizes[i],
                merkle.inclusion_path_length(i, n),
                foreign=i == k,
            )
            for i in range(n)
        ]

    want = 0 if side == "last-of-first-part" else 1
    k = next(k for k in range(n // 2 - 200, n // 2 + 200) if _split_line(sizes_with(k)) + want == k)
    assert sum(sizes_with(k)) >= offline_full._PARALLEL_MIN_BYTES
    ledger = open_ledger(sqlite_url)
    ledger.append_many([_big_event(i) for i in range(k)])
    _insert(ledger, foreign)
    ledger.append_many([_big_event(i) for i in range(k + 1, n)])
    out = tmp_path / "b"
    ledger.export(out, renderings=False)
    path = out / bundle.ENTRIES
    parts = offline_full.split(path, True)
    assert len(parts) == 2, "the parallel path did not run"
    with open(path, "rb") as f:
        f.seek(parts[1].start)
        assert f.readline().startswith(b'{"event":null,') == (want == 1)
    for full in (True, False):
        assert _verify(out, key, full=full).foreign == (k,)
    # an event next to the split rewritten as foreign is refused in the parallel path too
    neighbour = k + 1 if want == 0 else k - 1
    old = json.loads(path.read_bytes().splitlines()[neighbour])
    leaf = prepare_entry(_big_event(neighbour)).leaf
    _rewrite_line(
        out, neighbour, bundle.entry_line(neighbour, leaf, old["inclusion_proof"], foreign=True)
    )
    _resign(ledger, out)
    for full in (True, False):
        with pytest.raises(VerificationError, match="carried as a foreign entry"):
            _verify(out, key, full=full)


# ---------------------------------------------------------------------------------------------
# Regex cost on crafted leaves


_MB = 1 << 20
_CRAFTED = {
    "long-string-failing-at-v": _leaf(details=b'{"a":"' + b"x" * _MB + b'"}')[:-2] + b"2}",
    "many-pairs-failing-at-v": _leaf(details=b"{" + b",".join([b'"k":1'] * 150_000) + b"}")[:-2]
    + b"2}",
    "escapes-then-garbage": _leaf(details=b'{"a":"' + b"\\n" * (_MB // 2) + b'"}') + b" ",
    "many-ids-then-garbage": _leaf(block_ids=b"[" + b",".join([b"123456789"] * 100_000) + b"]")
    + b" ",
    "digits-then-garbage": _leaf(details=b'{"a":' + b"1" * _MB + b"}") + b" ",
    "unterminated-backslashes": b'{"block_ids":[],"details":{"a":"' + b"\\\\" * (_MB // 2),
    "almost-escape": _leaf(details=b'{"a":"' + b"\\u12" * (_MB // 4) + b'"}'),
}


@pytest.mark.parametrize("name", list(_CRAFTED))
def test_regex_has_no_catastrophic_backtracking(name: str) -> None:
    leaf = _CRAFTED[name]
    assert len(leaf) >= 900_000
    started = time.perf_counter()
    assert not bundle.is_event(leaf)
    elapsed = time.perf_counter() - started
    assert elapsed < 3.0, f"{name}: {elapsed:.2f} s for {len(leaf)} bytes"
