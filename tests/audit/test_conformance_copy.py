"""The conformance vectors carried in tests/conformance/ are the workplace's shared ones, unchanged
(issue 13, item 7): where `../shared/conformance/` exists, every file there is here byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import CONFORMANCE

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "conformance"


def test_the_carried_vectors_are_the_shared_ones() -> None:
    if not SHARED.is_dir():
        pytest.skip(f"no shared conformance folder at {SHARED} to compare with (a bare clone)")
    shared = {p.relative_to(SHARED) for p in SHARED.rglob("*") if p.is_file()} - {Path("README.md")}
    carried = {p.relative_to(CONFORMANCE) for p in CONFORMANCE.rglob("*") if p.is_file()}
    assert shared <= carried, sorted(shared - carried)[:5]
    for rel in shared:
        assert (CONFORMANCE / rel).read_bytes() == (SHARED / rel).read_bytes(), rel


def test_every_carried_case_is_run() -> None:
    cases = list((CONFORMANCE / "merkle").rglob("*.json"))
    assert len(cases) > 150  # 196 transparency-dev cases when this was written
