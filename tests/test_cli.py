from __future__ import annotations

import os

from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.control.commands import CommandQueue
from kvguard.control.keys import TenantKeys
from kvguard.isolation import Keyring
from tests.dbs import sqlite_with_tenants

runner = CliRunner()


def test_help_and_version() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "keys" in result.output
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("kvguard ")


def test_salt_keyring_create_and_rotate(tmp_path) -> None:
    out = tmp_path / "salt.keys"
    assert runner.invoke(app, ["keys", "salt-keyring", "--out", str(out)]).exit_code == 0
    assert os.stat(out).st_mode & 0o777 == 0o600
    first = Keyring.load(out)
    result = runner.invoke(app, ["keys", "salt-keyring", "--out", str(out), "--rotate", "k2"])
    assert result.exit_code == 0, result.output
    ring = Keyring.load(out)
    assert ring.active == "k2" and ring.secret("k1") == first.secret("k1")
    assert first.secret("k1").hex() not in result.output


def test_salt_keyring_rotation_refuses_a_link(tmp_path) -> None:
    """Rotating through a symbolic link replaced the link with a rotated file and left the file
    the engines read unrotated, reported done (found by a review): refused, nothing changed."""
    real = tmp_path / "secrets" / "salt.keys"
    assert runner.invoke(app, ["keys", "salt-keyring", "--out", str(real)]).exit_code == 0
    link = tmp_path / "salt.keys"
    link.symlink_to(real)
    result = runner.invoke(app, ["keys", "salt-keyring", "--out", str(link), "--rotate", "k2"])
    assert result.exit_code == 2 and "symbolic link" in result.output, result.output
    assert link.is_symlink() and Keyring.load(real).active == "k1"


def test_salt_keyring_refuses_to_overwrite(tmp_path) -> None:
    out = tmp_path / "salt.keys"
    runner.invoke(app, ["keys", "salt-keyring", "--out", str(out)])
    result = runner.invoke(app, ["keys", "salt-keyring", "--out", str(out)])
    assert result.exit_code == 2 and "already exists" in result.output  # usage error


def test_tenant_key_create_list_revoke(tmp_path) -> None:
    import sqlalchemy as sa  # noqa: PLC0415

    from kvguard.control.tenants import TenantRegistry  # noqa: PLC0415

    url = f"sqlite:///{tmp_path / 't.db'}"
    missing_db = runner.invoke(app, ["keys", "tenant-key", "create", "acme", "--db", url])
    assert missing_db.exit_code == 2 and "does not exist" in missing_db.output
    assert not (tmp_path / "t.db").exists()  # a mistyped --db makes no database
    assert runner.invoke(app, ["db", "migrate", "--db", url]).exit_code == 0
    refused = runner.invoke(app, ["keys", "tenant-key", "create", "acme", "--db", url])
    assert refused.exit_code == 1 and "not found" in refused.output  # unregistered tenant
    TenantRegistry(sa.create_engine(url)).create("acme", display_name="Acme", created_by="t")
    result = runner.invoke(app, ["keys", "tenant-key", "create", "acme", "--db", url])
    assert result.exit_code == 0, result.output
    key = result.output.strip().splitlines()[-1]
    keys = TenantKeys.open(url)
    assert keys.tenant_for(key) == "acme"
    key_id = key.split("_")[1]
    listed = runner.invoke(app, ["keys", "tenant-key", "list", "--db", url, "--json"])
    assert listed.exit_code == 0 and key_id in listed.output and key not in listed.output
    revoked = runner.invoke(app, ["keys", "tenant-key", "revoke", key_id, "--db", url])
    assert revoked.exit_code == 0, revoked.output
    assert keys.tenant_for(key) is None
    missing = runner.invoke(app, ["keys", "tenant-key", "revoke", "000000000000", "--db", url])
    assert missing.exit_code == 1 and "not found" in missing.output


def test_purge_command_is_queued_and_usage_errors_exit_2(tmp_path) -> None:
    missing = f"sqlite:///{tmp_path / 'typo.db'}"  # a mistyped path: refused, nothing created
    assert runner.invoke(app, ["purge", "--db", missing, "--model", "m"]).exit_code == 2
    assert not (tmp_path / "typo.db").exists()
    url = sqlite_with_tenants(tmp_path / "c.db", "acme")
    unknown = runner.invoke(app, ["purge", "--db", url, "--tenant", "acme-typo"])
    assert unknown.exit_code == 1, unknown.output  # as the API's 404: an erasure of nothing
    result = runner.invoke(app, ["purge", "--db", url, "--tenant", "acme"])
    assert result.exit_code == 0, result.output
    (command,) = CommandQueue.open(url).pending_after(0)
    assert command.selector.value == "acme"
    assert runner.invoke(app, ["purge", "--db", url]).exit_code == 2
    assert runner.invoke(app, ["purge", "--db", url, "--session", "s1"]).exit_code == 2
    assert (
        runner.invoke(app, ["purge", "--db", url, "--model", "m", "--adapter", "a"]).exit_code == 2
    )
    from tests.test_cli_conventions import _live_engine  # noqa: PLC0415

    _live_engine(url)  # one engine live, and it never answers
    result = runner.invoke(app, ["purge", "--db", url, "--tenant", "acme", "--wait", "0.3"])
    assert result.exit_code == 1 and "no engine acknowledged" in result.output


def test_verifier_key_prints_what_signing_key_printed(tmp_path) -> None:
    key_file = tmp_path / "ledger.key"
    made = runner.invoke(app, ["keys", "signing-key", "log.example", "--out", str(key_file)])
    assert made.exit_code == 0
    shown = runner.invoke(app, ["keys", "verifier-key", str(key_file)])
    assert shown.exit_code == 0 and shown.output == made.output
    assert shown.output.startswith("log.example+") and "PRIVATE" not in shown.output
    assert runner.invoke(app, ["keys", "verifier-key", str(tmp_path / "none.key")]).exit_code == 2
    key_file.chmod(0o644)  # a secret readable by others is refused, not used
    refused = runner.invoke(app, ["keys", "verifier-key", str(key_file)])
    assert refused.exit_code == 2 and "witness" not in refused.output  # the file's problem named
    # A witness's key prints its verifier key too (it said "not an Ed25519 signing key").
    witness_file = tmp_path / "w.key"
    made = runner.invoke(app, ["keys", "witness-key", "w.example", "--out", str(witness_file)])
    shown = runner.invoke(app, ["keys", "verifier-key", str(witness_file)])
    assert shown.exit_code == 0 and shown.output == made.output, shown.output


def test_demo_without_vllm_says_how_to_install_it(monkeypatch) -> None:
    import importlib.util  # noqa: PLC0415

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 2
    assert "pip install 'kvguard[vllm]'" in result.output and "Traceback" not in result.output
