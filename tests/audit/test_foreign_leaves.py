"""Foreign leaves: rows that something other than kvguard wrote at the head of the log.

docs/audit.md (Append guards): a role holding INSERT on `ledger_entries` (the engines' app role) can
append a row with a correct leaf hash; the log moves on past it. Before this module's fix, a leaf
that is not a kvguard event (not JSON, not an event, an event spread over two lines) stopped every
later complete export for good ("leaf is not a valid event"), made the streamed export write a
bundle that does not verify, and made listings that reached it fail. Now such a leaf is a *foreign*
entry (`bundle.leaf_event` is None): complete exports carry it as `"event":null` with its leaf in
base64 and its proof, filtered exports and listings leave it out (no filter selects what is not an
event), the renderings skip it, and the verifier proves it part of the log and names it in a
warning. An exporter cannot hide an event that way: a line carrying a real event as foreign fails.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvguard.audit import bundle, manifest
from kvguard.audit.bundle_stream import BundleStream, ExportQuery
from kvguard.audit.cli import audit_app, verify_command
from kvguard.audit.erasure_query import find_job_evidence
from kvguard.audit.leaf import prepare_entry
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError
from tests.dbs import migrate_and_grant, pg_roles

from .conftest import ORIGIN, T0, make_event, unpack_stream

Opener = Callable[..., Ledger]

_AT_HEAD_SQLITE = (
    "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
    "SELECT size, ?, ?, 'block.alloc', 0 FROM ledger_head"
)
_AT_HEAD_PG = (
    "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
    "SELECT size, %s, %s, 'block.alloc', 0 FROM ledger_head"
)


def _event_leaf(i: int) -> bytes:
    return prepare_entry(make_event(i)).leaf


FOREIGN = {
    "not-json": b"not an event",
    "invalid-utf8": b"\xff\xfe{}",
    "json-not-event": b'{"kind":"block.alloc"}',
    "event-on-two-lines": _event_leaf(99).replace(b',"details"', b',\n"details"', 1),
    "event-with-an-extra-field": _event_leaf(98)[:-1] + b',"x":1}',
    "event-hiding-a-commitment": _event_leaf(97).replace(
        b',"payload_commitment":null', b',"payload_commitment": null', 1
    ),
}


def _leaf_hash(leaf: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + leaf).digest()


def _foreign_log(ledger: Ledger, leaf: bytes) -> int:
    """Events 0-5, the foreign leaf at index 6 (its row claims kind block.alloc), events 7-9."""
    ledger.append_many([make_event(i) for i in range(6)])
    with ledger.store.engine.begin() as conn:
        conn.exec_driver_sql(_AT_HEAD_SQLITE, (leaf, _leaf_hash(leaf)))
    ledger.append_many([make_event(i) for i in range(7, 10)])
    return 6


def test_every_foreign_kind_is_recognised_and_every_event_is_not() -> None:
    for name, leaf in FOREIGN.items():
        assert bundle.leaf_event(leaf) is None, name
    for i in range(8):
        assert bundle.leaf_event(_event_leaf(i)) == json.loads(_event_leaf(i))
    committed = prepare_entry(make_event(3, payload={"user": "carol"})).leaf
    assert b'"payload_commitment":"' in committed
    assert bundle.leaf_event(committed) is not None


@pytest.mark.parametrize("name", list(FOREIGN))
def test_complete_export_carries_a_foreign_leaf_and_verifies(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path, name: str
) -> None:
    ledger = open_ledger(sqlite_url)
    index = _foreign_log(ledger, FOREIGN[name])
    summary = ledger.export(tmp_path / "b")
    assert (summary.entries, summary.tree_size) == (10, 10)
    lines = (tmp_path / "b" / bundle.ENTRIES).read_bytes().splitlines()
    assert len(lines) == 10
    line = json.loads(lines[index])
    assert line["event"] is None
    assert bundle.b64(FOREIGN[name]) == line["leaf"]
    assert all(json.loads(x)["event"] is not None for j, x in enumerate(lines) if j != index)
    # the renderings hold the nine events only
    csv_lines = (tmp_path / "b" / bundle.CSV).read_text().splitlines()
    assert len(csv_lines) == 1 + 9
    assert not any(x.startswith(f"{index},") for x in csv_lines)
    for full in (False, True):
        report = verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=full)
        assert (report.entries, report.foreign, report.complete) == (10, (index,), True)
    # the streamed export is byte for byte the directory export without renderings, and verifies
    reference = tmp_path / "plain"
    ledger.export(reference, renderings=False)
    unpacked = unpack_stream(BundleStream(ledger, ExportQuery()), tmp_path / "tar")
    assert (unpacked / bundle.ENTRIES).read_bytes() == (reference / bundle.ENTRIES).read_bytes()
    report = verify_bundle(unpacked, [key.verifier_key()], origin=ORIGIN, full=True)
    assert report.foreign == (index,)


def test_filtered_exports_and_listings_leave_a_foreign_leaf_out(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    """The row's `kind` column says block.alloc, so a block.alloc filter reaches it; it is not an
    event, so it is left out, not a reason to stop."""
    ledger = open_ledger(sqlite_url)
    index = _foreign_log(ledger, FOREIGN["not-json"])
    allocs = [i for i in range(10) if i != index and i % 4 == 0]  # make_event's block.alloc ones
    summary = ledger.export(tmp_path / "b", kinds=["block.alloc"])
    assert summary.entries == len(allocs)
    report = verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN)
    assert report.foreign == ()
    got = [json.loads(x)["index"] for x in (tmp_path / "b" / bundle.ENTRIES).read_text().split()]
    assert got == allocs
    unpacked = unpack_stream(
        BundleStream(ledger, ExportQuery(kinds=["block.alloc"])), tmp_path / "t"
    )
    assert (unpacked / bundle.ENTRIES).read_bytes() == (
        tmp_path / "b" / bundle.ENTRIES
    ).read_bytes()
    verify_bundle(unpacked, [key.verifier_key()], origin=ORIGIN)
    # listings: the foreign row is skipped and paging goes past it
    page = ledger.query(kinds=["block.alloc"], limit=100)
    assert [r.index for r in page.records] == allocs
    seen, after = [], None
    while True:
        page = ledger.query(after=after, limit=1)
        seen += [r.index for r in page.records]
        if page.next_after is None:
            break
        after = page.next_after
    assert seen == [i for i in range(10) if i != index]
    assert ledger.query(after=index - 1, limit=1).records == []  # GET /entries/6: not found


def test_an_exporter_cannot_carry_an_event_as_foreign(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    """A dishonest exporter (it holds the signing key and re-signs the manifest) rewrites an event's
    line as foreign, hiding it from readers of `event` and from the renderings: refused."""
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(8)])
    out = tmp_path / "b"
    ledger.export(out, renderings=False)
    path = out / bundle.ENTRIES
    lines = path.read_text().splitlines(keepends=True)
    victim = json.loads(lines[3])
    lines[3] = bundle.entry_line(3, _event_leaf(3), victim["inclusion_proof"], foreign=True)
    assert json.loads(lines[3])["event"] is None
    path.write_text("".join(lines))
    signed = (out / manifest.MANIFEST).read_text(encoding="utf-8")
    text = manifest.parse_manifest(signed.split("\n\n")[0] + "\n")
    files = {**text.files, bundle.ENTRIES: manifest.file_digest(path)}
    forged = manifest.format_manifest(manifest.Manifest(**{**text.__dict__, "files": files}))
    (out / manifest.MANIFEST).write_text(ledger.sign_note(forged))
    for full in (False, True):
        with pytest.raises(
            VerificationError, match="a kvguard event is carried as a foreign entry"
        ):
            verify_bundle(out, [key.verifier_key()], origin=ORIGIN, full=full)


def test_the_verify_command_warns_about_foreign_entries(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    index = _foreign_log(ledger, FOREIGN["json-not-event"])
    ledger.export(tmp_path / "b")
    app = typer.Typer()
    app.command("verify")(verify_command)
    app.add_typer(audit_app, name="audit")
    args = ["verify", str(tmp_path / "b"), "--key", key.verifier_key(), "--origin", ORIGIN]
    human = CliRunner().invoke(app, args)
    assert human.exit_code == 0, human.output
    assert "WARNING: 1 entries are not kvguard events" in human.output
    assert human.output.rstrip().endswith(f": {index}")
    machine = CliRunner().invoke(app, [*args, "--json"])
    assert machine.exit_code == 0
    assert json.loads(machine.stdout)["foreign_entries"] == [index]


def test_postgres_app_role_foreign_leaf_does_not_stop_exports(
    pg_url: str, key: SigningKey, tmp_path: Path
) -> None:
    """The same INSERT as the least-privilege app role of `kvguard db grants` on PostgreSQL."""
    with pg_roles(pg_url) as (owner_url, app_url, app_role):
        migrate_and_grant(owner_url, app_role)
        ledger = Ledger.open(app_url, origin=ORIGIN, signing_key=key)
        try:
            ledger.append_many([make_event(i) for i in range(6)])
            leaf = FOREIGN["not-json"]
            engine = sa.create_engine(app_url)
            try:
                with engine.begin() as conn:
                    conn.exec_driver_sql(_AT_HEAD_PG, (leaf, _leaf_hash(leaf)))
            finally:
                engine.dispose()
            ledger.append_many([make_event(i) for i in range(7, 10)])
            ledger.export(tmp_path / "b")
            report = verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)
            assert report.foreign == (6,)
            unpacked = unpack_stream(BundleStream(ledger, ExportQuery()), tmp_path / "tar")
            verify_bundle(unpacked, [key.verifier_key()], origin=ORIGIN, full=True)
            tenant = unpack_stream(
                BundleStream(ledger, ExportQuery(scope_tags=["st-tenant0"])), tmp_path / "t"
            )
            assert verify_bundle(tenant, [key.verifier_key()], origin=ORIGIN).foreign == ()
        finally:
            ledger.close()


_TEXT = st.text(max_size=40)  # any code point but surrogates: quotes, backslashes, controls, é, 😀
_SCALAR = st.one_of(
    _TEXT,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(
    details=st.dictionaries(st.sampled_from([f"k{i}" for i in range(8)]), _SCALAR, max_size=8),
    request_id=st.one_of(
        st.none(),  # printable ASCII (the model's rule), quotes and backslashes included
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=30),
    ),
    block_ids=st.lists(st.integers(min_value=0, max_value=2**40), max_size=6),
    micros=st.integers(min_value=0, max_value=10**15),
)
def test_every_leaf_kvguard_writes_is_an_event(
    details: dict[str, Any], request_id: str | None, block_ids: list[int], micros: int
) -> None:
    """The pattern behind `bundle.is_event` admits whatever kvguard's own encoder writes (else a
    genuine entry would be exported as foreign), and what it admits parses to the same fields."""
    try:
        event = make_event(
            1,
            details=details,
            request_id=request_id,
            block_ids=block_ids,
            ts=datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros),
        )
    except ValueError:  # the event model refuses it (e.g. a value that reads like a secret)
        return
    leaf = prepare_entry(event).leaf
    assert bundle.is_event(leaf), leaf
    parsed = bundle.leaf_event(leaf)
    assert parsed is not None
    assert (parsed["details"], parsed["request_id"], parsed["block_ids"]) == (
        dict(event.details),
        event.request_id,
        list(event.block_ids),
    )


def test_foreign_rows_linked_to_a_job_do_not_stop_its_erasure_evidence(
    open_ledger: Opener, sqlite_url: str
) -> None:
    """A role holding INSERT adds rows at the head and links them to purge job 5 and to its
    purge's blocks (the link tables accept links to any entry in the log): a foreign leaf, and a
    canonical `block.zeroize` event that is no engine's clear. Both prove nothing; before, either
    made finding the job's evidence raise, so no certificate could be issued for it."""
    ledger = open_ledger(sqlite_url)
    request = make_event(
        0,
        kind="admin.action",
        scope_tag="tt_acme",
        block_ids=[],
        details={"action": "purge.create", "outcome": "ok", "principal": "key:a", "job_id": 5},
    )
    purge = make_event(
        1,
        kind="tenant.purge",
        block_ids=[1, 2],
        details={"command_id": 5, "blocks_quarantined": 2, "blocks_active_doomed": 0},
    )
    ledger.append_many([request, purge])
    bogus_clear = make_event(2, kind="block.zeroize", block_ids=[1, 2], details={"handover": 3})
    with ledger.store.engine.begin() as conn:
        for leaf, kind in (
            (FOREIGN["not-json"], "block.zeroize"),
            (prepare_entry(bogus_clear).leaf, "block.zeroize"),
        ):
            conn.exec_driver_sql(
                "INSERT INTO ledger_entries (idx, leaf, leaf_hash, kind, ts_us) "
                "SELECT size, ?, ?, ?, ? FROM ledger_head",
                (leaf, _leaf_hash(leaf), kind, int(T0.timestamp() * 1e6) + 2000),
            )
        for idx in (2, 3):
            conn.exec_driver_sql(
                "INSERT INTO ledger_entry_commands (command_id, idx) VALUES (5, ?)", (idx,)
            )
            for block in (1, 2):
                conn.exec_driver_sql(
                    "INSERT INTO ledger_entry_blocks (block_id, idx) VALUES (?, ?)", (block, idx)
                )
    clear = make_event(
        4,
        kind="block.zeroize",
        block_ids=[1, 2],
        details={
            "handover": False,
            "verify_mode": "sample",
            "verified": True,
            "method": "torch",
            "device": "cpu",
            "block_count": 2,
            "bytes_cleared": 8192,
        },
    )
    ledger.append_many([clear])
    evidence = find_job_evidence(
        ledger, 5, since=T0 - timedelta(minutes=5), until=T0 + timedelta(minutes=5)
    )
    assert evidence.request == 0
    assert [p.index for p in evidence.purges] == [1]
    assert [z.index for z in evidence.zeroizes] == [4]
    assert evidence.coverage.complete


@pytest.mark.parametrize(
    "value", [0.0005015233418591654, 0.00012345678901234567, -0.00010000000000000002]
)
def test_small_floats_repr_writes_without_an_exponent_are_events(value: float) -> None:
    """`repr` writes floats down to 1e-4 without an exponent, with up to 20 fraction digits (three
    zeros, then 17 significant digits). The leaf pattern allowed 17, so a genuine entry with such a
    detail read as foreign (found by the property test above)."""
    leaf = prepare_entry(make_event(1, details={"k0": value})).leaf
    assert bundle.is_event(leaf), leaf
