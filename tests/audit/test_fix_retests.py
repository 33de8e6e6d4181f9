"""Independent re-test of the fixes in 3d651fd, 061735e, 986bfdc and 9992fa6 (pooling refusal, model
list without server paths, filtered exports held to their leaves and selection, missing subtree
hashes computed on read).

The audit findings' tests are here; each failed on the code it was written against and passes
since the fixes. F3's check is in test_verify_tampers.py (the head-insert test), F4's in
tests/engine_adapter/test_serve_edges.py, F6's in tests/engine_adapter/test_served_routes.py. F5 is
documented, not fixed (docs/vllm.md: serve a local model with `--served-model-name`).

- F1 (medium): the API's streamed export (`GET /v1/audit/export`, `bundle_stream.BundleStream`)
  still selects by the index columns: an entry whose `scope_tag` or `ts_us` column is moved out of
  the filter is silently left out, the manifest signs the shorter selection and `kvguard verify`
  says valid. 986bfdc fixed only `kvguard audit export` (`export._rows`).
- F2 (low): `kvguard verify` holds a filtered bundle to its signed selection only for the
  `scope_tag` key that `kvguard audit export` writes; the API writes `scope_tags`, which
  `offline._in_selection` ignores, so another tenant's entries under this tenant's label verify.
- F3 (low): after a row inserted at the head (9992fa6's case), `Ledger.inclusion_proof` and
  `Ledger.consistency_proof` (the API's proof routes, the witnesses' consistency proofs) still fail
  with "stored hash of subtree ... is missing": only `complete_reader` users were changed, not
  `store.hashes_for_ranges`.
- F4 (low): a LoRA adapter whose directory is missing or empty answers a tenant's request with
  400 "LoRA adapter at /server/path has no files" (`adapters.adapter_digest`).
- F5 (low): `GET /v1/models` still shows the base model's path (vLLM's default served name is the
  model argument: card `id`, the rewritten `root` and each LoRA card's `parent`), and every
  unknown-model 404 lists it as a "valid alias".
- F6 (low, usability): a model vLLM pools on its own (`--hf-overrides` architectures) is refused
  only by the connector inside the engine core: `kvguard engine serve` dies with vLLM's "Engine
  core initialization failed" traceback instead of exit 2 with the one-line reason.
"""

from __future__ import annotations

import io
import json
import sqlite3
import tarfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from kvguard.audit import note
from kvguard.audit.bundle_stream import BundleStream, ExportQuery
from kvguard.audit.ledger import Ledger
from kvguard.audit.manifest import Manifest, file_digest, format_manifest, parse_manifest
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError

from .conftest import ORIGIN, T0, make_event


def _ledger(open_ledger: Callable[..., Ledger], url: str, n: int = 24) -> Ledger:
    ledger = open_ledger(url)
    ledger.append_many([make_event(i) for i in range(n // 2)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(n // 2, n)])
    return ledger


def _verify(bundle: Path, key: SigningKey) -> Any:
    return verify_bundle(bundle, [key.verifier_key()], origin=ORIGIN, parallel=False)


def _untar(stream: BundleStream, into: Path) -> Path:
    """The streamed archive unpacked, as an auditor does with the API's download."""
    data = b"".join(stream)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(into, filter="data")
    return next(into.iterdir())


def _indices(bundle: Path) -> list[int]:
    lines = (bundle / "entries.jsonl").read_text().splitlines()
    return [json.loads(line)["index"] for line in lines]


# --- F1: the API's streamed export still hides a row edited out of its filter -----------------


@pytest.mark.parametrize(
    ("column", "value", "query"),
    [
        ("scope_tag", "st-elsewhere", ExportQuery(scope_tags=["st-tenant0"])),
        ("ts_us", 0, ExportQuery(since=T0, until=T0 + timedelta(hours=1))),
    ],
)
def test_api_stream_export_refuses_a_row_edited_out_of_its_filter(
    column: str,
    value: object,
    query: ExportQuery,
    sqlite_url: str,
    open_ledger: Callable[..., Ledger],
    key: SigningKey,
    tmp_path: Path,
) -> None:
    """`kvguard audit export --tenant` now refuses this ledger ("index columns do not match the
    leaf"); the API's export of the same selection left entry 3 out and verified."""
    ledger = _ledger(open_ledger, sqlite_url)
    hidden = 3  # st-tenant0, inside the time range
    assert hidden in _indices(_untar(BundleStream(ledger, query), tmp_path / "before"))
    raw = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    raw.execute("DROP TRIGGER ledger_entries_no_update")
    raw.execute(f"UPDATE ledger_entries SET {column} = ? WHERE idx = ?", (value, hidden))
    raw.close()
    with pytest.raises(VerificationError):
        bundle = _untar(BundleStream(ledger, query), tmp_path / "after")
        report = _verify(bundle, key)
        raise AssertionError(
            f"API export verified with {report.entries} entries: entry {hidden} hidden "
            f"({_indices(bundle)})"
        )


# --- F2: verify ignores the API's `scope_tags` selection ----------------------------------------


def test_verify_holds_an_api_bundle_to_its_scope_tags_selection(
    sqlite_url: str, open_ledger: Callable[..., Ledger], key: SigningKey, tmp_path: Path
) -> None:
    """An exporter holding the log's key labels st-tenant1's entries as st-tenant0's: refused for
    a `kvguard audit export` bundle (`scope_tag`), accepted for an API bundle (`scope_tags`)."""
    ledger = _ledger(open_ledger, sqlite_url)
    bundle = _untar(BundleStream(ledger, ExportQuery(scope_tags=["st-tenant1"])), tmp_path / "s")
    m = parse_manifest(note.split_note((bundle / "manifest").read_text())[0])
    assert m.selection == 'filtered {"scope_tags":["st-tenant1"]}'
    files = {
        p.name: file_digest(p)
        for p in bundle.iterdir()
        if p.is_file() and p.name not in {"checkpoint", "manifest"}
    }
    relabelled = m.selection.replace("st-tenant1", "st-tenant0")
    text = format_manifest(
        Manifest(m.origin, m.size, m.root, relabelled, m.entries, files, m.proofs)
    )
    (bundle / "manifest").write_text(note.join_note(text, [key.signature_line(text)]))
    with pytest.raises(VerificationError, match="outside the manifest's selection"):
        _verify(bundle, key)
