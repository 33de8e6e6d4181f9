"""Issue 13, item 2: key commands write secret files under the data directory by default (0600,
in a 0700 directory), never into the working tree, and never overwrite one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvguard.audit.signing import SigningKey
from kvguard.cli import app


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["keys", "salt-keyring"], "salt.keys"),
        (["keys", "signing-key", "log.example.com"], "ledger-signing.key"),
        (["keys", "witness-key", "witness.example.net"], "witness.key"),
    ],
)
def test_key_commands_write_under_the_data_dir(
    args: list[str], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(data))
    monkeypatch.chdir(tmp_path)
    created = CliRunner().invoke(app, args)
    assert created.exit_code == 0, created.output
    path = data / name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing in the working tree
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and path.read_bytes()  # refuses to overwrite (usage), file kept
    if name == "ledger-signing.key":
        assert SigningKey.load(path).verifier_key() in created.output


def test_a_key_file_that_is_not_text_is_refused_without_its_bytes(tmp_path: Path) -> None:
    """Found by a review: a non-UTF-8 signing-key file raised UnicodeDecodeError, whose message
    quotes a byte of the key, out of `kvguard serve`."""
    from kvguard.errors import ConfigError  # noqa: PLC0415

    path = tmp_path / "signing.key"
    path.write_bytes(b"\xffPRIVATE+KEY+secret-bytes")
    path.chmod(0o600)
    with pytest.raises(ConfigError) as refused:
        SigningKey.load(path)
    assert "xff" not in str(refused.value) and "secret" not in str(refused.value)
