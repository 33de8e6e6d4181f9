"""Changes made with the `kvguard` CLI are recorded like the admin API's: each commits with its
`admin.action` entry (principal `cli:<by>`, role `operator`) in the outbox, which the next process
holding the ledger drains; no key ever appears in an entry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from kvguard.api.services import Services
from kvguard.cli import app
from kvguard.control.db import open_engine
from kvguard.control.schema import OutboxRow
from kvguard.control.tenants import TenantRegistry
from tests.api.conftest import make_config


def test_cli_changes_reach_the_ledger_with_their_entries(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    TenantRegistry(open_engine(url)).create("acme", display_name="Acme", created_by="test")
    runner = CliRunner()
    outputs = []
    for args in (
        ["keys", "create", "--role", "auditor", "--db", url],
        ["keys", "tenant-key", "create", "acme", "--db", url],
        ["purge", "--tenant", "acme", "--db", url, "--by", "oncall"],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        outputs.append(result.output)
    admin_key_id = re.search(r"key ([0-9a-f]{12})", outputs[0]).group(1)  # type: ignore[union-attr]
    tenant_key_id = re.search(r"key id ([0-9a-f]{12})", outputs[1]).group(1)  # type: ignore[union-attr]
    for args in (
        ["keys", "revoke", admin_key_id, "--db", url],
        ["keys", "tenant-key", "revoke", tenant_key_id, "--db", url],
        ["keys", "tenant-key", "revoke", tenant_key_id, "--db", url],  # again: idempotent
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    assert "was already revoked" in result.output
    secrets = [line for out in outputs for line in out.split() if line.startswith("kvg_")]
    assert len(secrets) == 2

    engine = open_engine(url)
    with engine.connect() as conn:
        pending = conn.execute(sa.select(OutboxRow.event)).scalars().all()
    assert len(pending) == 6 and not any(s in e for s in secrets for e in pending)

    config, _key = make_config(tmp_path, url)
    services = Services.open(config)  # drains what the CLI left
    try:
        assert services.outbox.pending() == 0
        with services.ledger.store.engine.connect() as conn:
            leaves = conn.execute(
                sa.text("SELECT leaf FROM ledger_entries WHERE kind = 'admin.action' ORDER BY idx")
            ).scalars()
            actions = [json.loads(bytes(leaf))["details"] for leaf in leaves]
        cli = [a for a in actions if a["role"] == "operator"]
        assert [a["action"] for a in cli] == [
            "api_key.create",
            "inference_key.create",
            "purge.create",
            "api_key.revoke",
            "inference_key.revoke",
            "inference_key.revoke",
        ]
        # The repeat is recorded as what it was, not as a second revocation.
        assert cli[4]["already_revoked"] is False and cli[5]["already_revoked"] is True
        assert cli[2]["principal"] == "cli:oncall" and cli[2]["job_id"] == 1
        assert "acme" not in json.dumps(cli)  # the tenant id only in the erasable payloads
    finally:
        services.close()
        engine.dispose()


def test_cli_key_changes_name_the_tenant_tag_where_the_keyring_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the salt keyring (as `kvguard purge` uses it) a key change about a tenant names the
    tenant's `tt_` tag, so that it is in the tenant's own ledger view as the API's change is
    (the CLI's had none: the tenant_admin's export left out keys its key listing showed)."""
    from kvguard.isolation.keyring import Keyring  # noqa: PLC0415
    from kvguard.isolation.salts import SaltDeriver  # noqa: PLC0415

    keyring = Keyring.generate()
    keyring.save(tmp_path / "salt.keys")
    monkeypatch.setenv("KVGUARD_SALT_KEYRING_FILE", str(tmp_path / "salt.keys"))
    tag = SaltDeriver(keyring).tenant_tag("acme")
    url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    TenantRegistry(open_engine(url)).create("acme", display_name="Acme", created_by="test")
    runner = CliRunner()
    made = runner.invoke(app, ["keys", "tenant-key", "create", "acme", "--db", url])
    key_id = re.search(r"key id ([0-9a-f]{12})", made.output).group(1)  # type: ignore[union-attr]
    for args in (
        ["keys", "tenant-key", "revoke", key_id, "--db", url],
        ["keys", "create", "--role", "tenant_admin", "--tenant", "acme", "--db", url],
        ["keys", "create", "--role", "auditor", "--db", url],
    ):
        assert runner.invoke(app, args).exit_code == 0
    engine = open_engine(url)
    with engine.connect() as conn:
        events = [json.loads(e) for e in conn.execute(sa.select(OutboxRow.event)).scalars()]
    engine.dispose()
    assert [e.get("scope_tag") for e in events] == [tag, tag, tag, None]
