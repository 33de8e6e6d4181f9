"""Issue 13, item 2: every file kvguard creates that holds evidence is 0600 (directories 0700),
from the first byte: export bundles, saved checkpoints (`audit checkpoint --out`,
`verify --save-checkpoint`), whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.cli import app

from .conftest import ORIGIN, make_event

Opener = Callable[..., Ledger]


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0o022)  # the usual umask: files 0644 unless kvguard says otherwise
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]
    }


def test_export_bundles_are_owner_only(
    open_umask: None, sqlite_url: str, open_ledger: Opener, tmp_path: Path
) -> None:
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(6)])
    ledger.append(make_event(6, payload={"user": "x"}))
    ledger.export(tmp_path / "b", tlog_proofs=True)
    modes = _modes(tmp_path / "b")
    assert len(modes) > 10
    for name, mode in modes.items():
        expected = 0o700 if (tmp_path / "b" / name).is_dir() else 0o600
        assert mode == expected, (name, oct(mode))


def test_saved_checkpoints_are_owner_only(
    open_umask: None, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    key_file = tmp_path / "k"
    key.save(key_file)
    ledger = Ledger.open(sqlite_url, origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(3)])
    ledger.export(tmp_path / "b")
    ledger.close()
    common = ["--db", sqlite_url, "--origin", ORIGIN, "--key", str(key_file)]
    runner = CliRunner()
    out = tmp_path / "cp"
    assert runner.invoke(app, ["audit", "checkpoint", *common, "--out", str(out)]).exit_code == 0
    saved = tmp_path / "kept"
    verified = runner.invoke(
        app,
        ["verify", str(tmp_path / "b"), "--key", key.verifier_key(), "--origin", ORIGIN,
         "--save-checkpoint", str(saved)],
    )  # fmt: skip
    assert verified.exit_code == 0, verified.output
    for path in (out, saved):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
