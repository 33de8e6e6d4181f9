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


def test_export_into_a_symbolic_link_is_refused_and_its_target_keeps_its_mode(
    open_umask: None, sqlite_url: str, key: SigningKey, tmp_path: Path
) -> None:
    """A link planted where the export goes (a shared directory) must not have kvguard chmod its
    target or write evidence there; the command names the problem and exits 2."""
    key_file = tmp_path / "k"
    key.save(key_file)
    ledger = Ledger.open(sqlite_url, origin=ORIGIN, signing_key=key)
    ledger.append_many([make_event(i) for i in range(3)])
    ledger.close()
    target = tmp_path / "someone-elses"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    link = tmp_path / "export"
    link.symlink_to(target)
    common = ["--db", sqlite_url, "--origin", ORIGIN, "--key", str(key_file)]
    result = CliRunner().invoke(app, ["audit", "export", *common, "--out", str(link)])
    assert result.exit_code == 2, result.output
    assert "symbolic link" in result.output
    assert "Traceback" not in result.output
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert not any(target.iterdir())
