"""`kvguard keys create|revoke` and `kvguard serve`'s fail-closed start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from kvguard.api.auth import ApiKeys, Role
from kvguard.api.cli import _bind_problem
from kvguard.audit.db import create_engine
from kvguard.cli import app
from kvguard.cli_output import connect_problem
from kvguard.control.db import open_engine
from kvguard.control.schema import AdminKeyRow, OutboxRow
from kvguard.control.tenants import TenantRegistry

runner = CliRunner()


def test_keys_create_prints_a_working_key_once(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'k.db'}"
    TenantRegistry(open_engine(db)).create("acme", display_name="Acme", created_by="test")
    result = runner.invoke(
        app, ["keys", "create", "--role", "tenant_admin", "--tenant", "acme", "--db", db]
    )
    assert result.exit_code == 0, result.output
    key = result.output.strip().splitlines()[-1]
    principal = ApiKeys(create_engine(db)).authenticate(key)
    assert principal is not None and principal.role is Role.TENANT_ADMIN
    assert principal.tenant_id == "acme"
    revoked = runner.invoke(app, ["keys", "revoke", principal.key_id, "--db", db])
    assert revoked.exit_code == 0
    assert ApiKeys(create_engine(db)).authenticate(key) is None
    assert runner.invoke(app, ["keys", "revoke", principal.key_id, "--db", db]).exit_code == 1


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--role", "root"], 2, "--role must be one of"),
        (["--role", "tenant_admin"], 2, "needs --tenant"),
        (["--role", "admin", "--tenant", "acme"], 2, "needs --tenant"),
        # an environment error (docs/cli.md): 2, was 1 before issue 13, item 5
        (["--role", "admin", "--db", "sqlite:////nonexistent/dir/x.db"], 2, "does not exist"),
    ],
)
def test_keys_create_refuses_bad_input(
    tmp_path: Path, args: list[str], code: int, says: str
) -> None:
    if "--db" not in args:
        args = [*args, "--db", f"sqlite:///{tmp_path / 'k.db'}"]
        TenantRegistry(open_engine(args[-1])).create("acme", display_name="A", created_by="t")
    result = runner.invoke(app, ["keys", "create", *args])
    assert result.exit_code == code, result.output
    assert says in result.output
    assert "Traceback" not in result.output


def test_keys_create_needs_an_existing_database_and_a_registered_tenant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mistyped --db path is refused, not made into a new database holding a key no server
    reads; a tenant_admin key only for a registered tenant (a key bound to a free id would govern
    whichever tenant is registered under it later). Nothing is stored by a refusal."""
    typo = tmp_path / "kvguatd.db"
    result = runner.invoke(app, ["keys", "create", "--role", "admin", "--db", f"sqlite:///{typo}"])
    assert result.exit_code == 2 and "does not exist" in result.output, result.output
    assert not typo.exists()

    db = f"sqlite:///{tmp_path / 'k.db'}"
    TenantRegistry(open_engine(db)).create("acme", display_name="Acme", created_by="test")
    args = ["keys", "create", "--role", "tenant_admin", "--tenant", "acme-typo", "--db", db]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
    with open_engine(db).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(AdminKeyRow)).scalar() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(OutboxRow)).scalar() == 0

    # The embedded default (no --db) is still made on first use: the README's first command.
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path / "fresh"))
    monkeypatch.delenv("KVGUARD_DB_URL", raising=False)
    first = runner.invoke(app, ["keys", "create", "--role", "admin"])
    assert first.exit_code == 0, first.output
    assert (tmp_path / "fresh").is_dir()


def test_serve_refuses_to_start_without_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (
        "KVGUARD_SALT_KEYRING_FILE",
        "KVGUARD_SIGNING_KEY_FILE",
        "KVGUARD_MODE",
        "KVGUARD_SALT_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    result = runner.invoke(app, ["serve", "--port", "1"])
    assert result.exit_code == 2  # missing secrets: an environment error (docs/cli.md)
    assert "KVGUARD_SALT_KEYRING_FILE" in result.output


def test_serve_says_which_database_it_cannot_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_MODE", "dev")
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    url = "postgresql+psycopg://kvguard:s3cret-pw@127.0.0.1:1/nowhere"
    result = runner.invoke(app, ["serve", "--db", url, "--port", "0"])
    assert result.exit_code == 2, result.output  # an environment error (docs/cli.md)
    assert "cannot open database postgresql+psycopg://kvguard:***@127.0.0.1:1/nowhere" in (
        result.output
    )
    assert "no connection to the server at 127.0.0.1:1: Connection refused" in result.output
    assert "s3cret-pw" not in result.output and "Traceback" not in result.output


def test_the_bind_check_before_the_banner_probes_what_the_server_would_bind() -> None:
    """`kvguard serve` checks its address before it prints the banner (the banner used to come
    first, then uvicorn's bind failed): every address the host resolves to, like uvicorn's server;
    the probes are closed again, so the server binds them afterwards."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _bind_problem("127.0.0.1", port) == "Address already in use"
        assert _bind_problem("localhost", port) is not None  # 127.0.0.1 among its addresses
        assert _bind_problem("no-such-host.invalid", port) is not None
    assert _bind_problem("127.0.0.1", port) is None
    assert _bind_problem("127.0.0.1", port) is None  # the probe itself holds nothing


def test_a_connect_error_containing_the_password_is_withheld_whole() -> None:
    """Masking each occurrence of a short password gave it away (`a`: `d***t***b***se`)."""
    exc = Exception(
        'connection failed: connection to server at "h", port 5432 failed: FATAL:  database '
        '"kvguard_prod" does not exist'
    )
    short = connect_problem(exc, "postgresql+psycopg://kvguard:a@h:5432/kvguard_prod")
    assert "withheld" in short and "***t***" not in short and "does not exist" not in short
    long = connect_problem(exc, "postgresql+psycopg://kvguard:L0ng-s3cret@h:5432/kvguard_prod")
    assert long.endswith('refused the connection: database "kvguard_prod" does not exist'), long
    assert "L0ng-s3cret" not in long
