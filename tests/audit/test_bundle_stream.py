"""Streamed export bundles: the tar holds exactly what `Ledger.export` writes, passes the offline
verifier, proves entries correctly on every chunk path (whole, partial, per-entry, right edge), and
fails rather than hand out a wrong archive."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvguard.audit import bundle, merkle
from kvguard.audit.bundle_stream import BundleStream, ExportQuery
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import verify_bundle
from kvguard.audit.proof_runs import CHUNK_BITS
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError

from .conftest import ORIGIN, make_event

Opener = Callable[..., Ledger]
CHUNK = 1 << CHUNK_BITS


def _unpack(stream: BundleStream, into: Path) -> Path:
    data = b"".join(stream)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        names = tar.getnames()
        assert all(n == stream.name or n.startswith(stream.name + "/") for n in names)
        tar.extractall(into, filter="data")
    return into / stream.name


def _event(i: int) -> object:
    # st-tenant0: every 3rd entry (dense); st-rare: every 997th (a few per chunk, per-entry proofs)
    return make_event(i, scope_tag="st-rare" if i % 997 == 5 else f"st-tenant{i % 3}")


@pytest.fixture
def big(open_ledger: Opener, sqlite_url: str) -> Ledger:
    """Two complete proof chunks, a right edge, and an older checkpoint (consistency.jsonl)."""
    ledger = open_ledger(sqlite_url)
    ledger.append_many([_event(i) for i in range(CHUNK + 100)])  # type: ignore[misc]
    ledger.checkpoint()
    ledger.append_many([_event(i) for i in range(CHUNK + 100, 2 * CHUNK + 777)])  # type: ignore[misc]
    return ledger


@pytest.mark.parametrize(
    "query",
    [
        ExportQuery(),
        ExportQuery(scope_tags=["st-tenant0"]),  # partial trees, right edge read whole
        ExportQuery(scope_tags=["st-rare"]),  # per-entry proofs from stored hashes
        ExportQuery(kinds=["block.zeroize"], scope_tags=["st-tenant1", "st-rare"]),
    ],
    ids=["complete", "dense-tenant", "sparse-tenant", "kind-and-tags"],
)
def test_streamed_bundle_equals_the_directory_export_and_verifies(
    big: Ledger, key: SigningKey, tmp_path: Path, query: ExportQuery
) -> None:
    stream = BundleStream(big, query)
    unpacked = _unpack(stream, tmp_path / "tar")
    report = verify_bundle(unpacked, [key.verifier_key()], origin=ORIGIN, full=query.complete)
    assert report.tree_size == stream.tree_size == big.size
    assert report.consistency_proofs == 1
    # byte for byte what the directory exporter writes for the same checkpoint
    tags = list(query.scope_tags or [])
    reference = tmp_path / "dir"
    big.export(reference, renderings=False, kinds=query.kinds, scope_tag=None)
    lines = (reference / bundle.ENTRIES).read_bytes().splitlines(keepends=True)
    wanted = [
        line
        for line in lines
        if (not tags or any(f'"scope_tag":"{t}","ts"'.encode() in line for t in tags))
    ]
    assert (unpacked / bundle.ENTRIES).read_bytes() == b"".join(wanted)
    assert (unpacked / bundle.CHECKPOINT).read_bytes() == (
        reference / bundle.CHECKPOINT
    ).read_bytes()
    assert (unpacked / bundle.CONSISTENCY).read_bytes() == (
        reference / bundle.CONSISTENCY
    ).read_bytes()


def test_gzip_stream_unpacks_to_the_same_bundle(
    big: Ledger, key: SigningKey, tmp_path: Path
) -> None:
    plain = _unpack(BundleStream(big, ExportQuery(scope_tags=["st-tenant2"])), tmp_path / "a")
    packed_stream = BundleStream(big, ExportQuery(scope_tags=["st-tenant2"]), gzip=True)
    assert packed_stream.media_type == "application/gzip"
    packed = _unpack(packed_stream, tmp_path / "b")
    verify_bundle(packed, [key.verifier_key()], origin=ORIGIN)
    for name in (bundle.CHECKPOINT, bundle.ENTRIES):
        assert (plain / name).read_bytes() == (packed / name).read_bytes()


def test_small_and_empty_exports(
    open_ledger: Opener, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append(make_event(0))
    one = _unpack(BundleStream(ledger, ExportQuery()), tmp_path / "one")
    verify_bundle(one, [key.verifier_key()], origin=ORIGIN, full=True)
    none = _unpack(BundleStream(ledger, ExportQuery(scope_tags=[])), tmp_path / "none")
    assert (none / bundle.ENTRIES).read_bytes() == b""
    verify_bundle(none, [key.verifier_key()], origin=ORIGIN)


def test_a_doctored_leaf_stops_the_stream(big: Ledger) -> None:
    with big.store.engine.begin() as conn:  # someone with the database file edits a leaf
        conn.exec_driver_sql("DROP TRIGGER ledger_entries_no_update")
        conn.execute(
            sa.text(
                "UPDATE ledger_entries SET leaf = CAST(replace(leaf, 'n4100', 'n4101') AS BLOB) WHERE idx = 4100"
            )
        )
    for query in (ExportQuery(), ExportQuery(scope_tags=["st-tenant2"])):
        with pytest.raises(VerificationError):
            b"".join(BundleStream(big, query))


def test_a_doctored_scope_column_cannot_slip_an_entry_into_a_tenant_export(big: Ledger) -> None:
    with big.store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER ledger_entries_no_update")
        conn.execute(sa.text("UPDATE ledger_entries SET scope_tag = 'st-tenant0' WHERE idx = 4"))
    with pytest.raises(VerificationError, match="entry 4: index columns"):
        b"".join(BundleStream(big, ExportQuery(scope_tags=["st-tenant0"])))


def test_entry_line_size_matches_the_rendered_line() -> None:
    for index, leaf_size, size in ((0, 0, 1), (5, 1, 6), (12345, 301, 99_999), (7, 2, 8)):
        leaf = b"x" * leaf_size
        hashes = merkle.inclusion_path_length(index, size)
        assert hashes == len(merkle.inclusion_ranges(index, size))
        line = bundle.entry_line(index, leaf, ["A" * 44] * hashes)
        assert len(line.encode()) == bundle.entry_line_size(index, leaf_size, hashes)
