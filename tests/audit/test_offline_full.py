"""`kvguard verify --full` internals: the cached audit-path text equals RFC 9162 PATH for every leaf,
and the two-process check covers every line: a change on either side of the split, at the split, or
at the end of the file fails and names the right entry, like the one-process check."""

from __future__ import annotations

import base64
import binascii
import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.audit import bundle, merkle, offline_full
from kvguard.audit.ledger import Ledger
from kvguard.audit.offline import verify_bundle
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError

from .conftest import ORIGIN, make_event

Opener = Callable[..., Ledger]


@given(st.integers(1, 300), st.data())
def test_path_text_is_the_rfc_9162_audit_path(size: int, data: st.DataObject) -> None:
    levels = merkle.tree_levels(merkle.leaf_hash(i.to_bytes(4, "big")) for i in range(size))
    paths = offline_full.PathText(levels)
    start = data.draw(st.integers(0, size - 1))
    for index in range(start, size):  # consecutive indices, as the check walks them
        expected = ",".join(
            '"' + binascii.b2a_base64(h, newline=False).decode() + '"'
            for h in merkle.levels_inclusion_proof(levels, index)
        )
        assert paths.path(index).decode() == expected


@pytest.fixture
def two_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split even small files in two, so the forked half is exercised."""
    monkeypatch.setattr(offline_full, "_PARALLEL_MIN_BYTES", 0)


def _bundle(open_ledger: Opener, url: str, out: Path, n: int) -> Path:
    ledger = open_ledger(url)
    ledger.append_many([make_event(i) for i in range(n)])
    ledger.export(out, renderings=False)
    return out / bundle.ENTRIES


def _expect_invalid(directory: Path, key: SigningKey, match: str | None) -> None:
    for parallel in (True, False):
        with pytest.raises(VerificationError, match=match):
            verify_bundle(
                directory, [key.verifier_key()], origin=ORIGIN, full=True, parallel=parallel
            )


@pytest.mark.usefixtures("two_parts")
def test_two_process_check_names_the_first_failing_entry_on_either_side(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    entries = _bundle(open_ledger, sqlite_url, tmp_path / "b", 301)
    parts = offline_full.split(entries, parallel=True)
    assert len(parts) == 2 and 0 < parts[0].stop == parts[1].start < entries.stat().st_size
    verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)
    original = entries.read_bytes()
    lines = original.splitlines(keepends=True)
    boundary = original[: parts[0].stop].count(b"\n")  # first line of the second part
    for index in (0, 7, boundary - 1, boundary, boundary + 5, len(lines) - 1):
        pos = lines[index].index(b'"inclusion_proof":["') + 25
        changed = list(lines)
        changed[index] = lines[index][:pos] + b"#" + lines[index][pos + 1 :]
        first = index
        if index > 3:  # a second bad line before it: that one must be named
            changed[3] = lines[3].replace(b'"index":3', b'"index":3 ')
            first = 3
        entries.write_bytes(b"".join(changed))
        _expect_invalid(tmp_path / "b", key, rf"line {first + 1} \(entry {first}\)")
    entries.write_bytes(original)
    verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)


@pytest.mark.usefixtures("two_parts")
@pytest.mark.parametrize(
    "edit",
    [
        "drop_last_newline",
        "extra_line",
        "duplicate_boundary_line",
        "drop_boundary_line",
        "swap_at_boundary",
    ],
)
def test_two_process_check_refuses_structural_edits(
    edit: str, sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    entries = _bundle(open_ledger, sqlite_url, tmp_path / "b", 200)
    original = entries.read_bytes()
    lines = original.splitlines(keepends=True)
    b = original[: offline_full.split(entries, parallel=True)[0].stop].count(b"\n")
    edited = {
        "drop_last_newline": [*lines[:-1], lines[-1][:-1]],
        "extra_line": [*lines, lines[-1]],
        "duplicate_boundary_line": [*lines[:b], lines[b - 1], *lines[b:]],
        "drop_boundary_line": lines[: b - 1] + lines[b:],
        "swap_at_boundary": [*lines[: b - 1], lines[b], lines[b - 1], *lines[b + 1 :]],
    }[edit]
    entries.write_bytes(b"".join(edited))
    _expect_invalid(tmp_path / "b", key, None)


@pytest.mark.usefixtures("two_parts")
def test_two_process_check_detects_any_flipped_byte(
    sqlite_url: str, open_ledger: Opener, key: SigningKey, tmp_path: Path
) -> None:
    entries = _bundle(open_ledger, sqlite_url, tmp_path / "b", 40)
    data = entries.read_bytes()
    rng = random.Random(3)
    for offset in {0, len(data) - 1, *rng.sample(range(len(data)), 150)}:
        flipped = bytearray(data)
        flipped[offset] ^= 1 << rng.randrange(8)
        entries.write_bytes(bytes(flipped))
        with pytest.raises(VerificationError):
            verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)
    entries.write_bytes(data)
    verify_bundle(tmp_path / "b", [key.verifier_key()], origin=ORIGIN, full=True)


def test_a_leaf_swapped_between_the_passes_is_caught(
    sqlite_url: str, open_ledger: Opener, tmp_path: Path
) -> None:
    """A canonical line for another leaf of the same length, written after pass 1: every line is
    still canonical for its leaf and PATH(i), so only the tie to pass 1's leaves can catch it."""
    entries = _bundle(open_ledger, sqlite_url, tmp_path / "b", 50)
    tree = offline_full.full_levels(entries, offline_full.split(entries, False), str, None, 50)
    lines = entries.read_bytes().splitlines(keepends=True)
    obj = json.loads(lines[17])
    leaf = base64.b64decode(obj["leaf"])
    # another event, one microsecond apart (a leaf that is not an event fails sooner)
    digit = b"1" if leaf[-10:-9] != b"1" else b"2"
    forged = leaf[:-10] + digit + leaf[-9:]
    assert forged != leaf and len(forged) == len(leaf) and bundle.is_event(forged)
    lines[17] = bundle.entry_line(17, forged, obj["inclusion_proof"]).encode()
    entries.write_bytes(b"".join(lines))
    with pytest.raises(VerificationError, match="changed while verifying"):
        offline_full.check_lines(entries, tree, str, None)
