"""Control-plane commands for `kvguard.cli` to mount: `kvguard purge`, `kvguard keys tenant-key
create|revoke|list` (inference keys of `kvguard engine serve`) and `kvguard db migrate|grants`.

Every command takes `--json` and follows the exit-code table of `kvguard.cli_output` (docs/cli.md):
0 ok; 1 the tenant or key named does not exist (or is disabled), or no engine acknowledged a purge
within `--wait`; 2 usage or environment (a bad option, a database it cannot open or migrate).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvguard.cli_output import (
    EXIT_INVALID,
    EXIT_USAGE,
    JsonOpt,
    emit,
    fail,
    progress,
    reporting,
    safe_url,
)
from kvguard.errors import ConfigError

MAX_WAIT_S = 86_400.0  # `purge --wait`: a day; engines acknowledge within seconds
NO_TENANT_TAG = (
    "warning: no salt keyring here (KVGUARD_SALT_KEYRING_FILE or KVGUARD_SALT_KEY): the purge is "
    "queued, but its ledger entry cannot name the tenant's tag, so no erasure certificate of it "
    "will verify"
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvguard.control.commands import CommandQueue, PurgeSelector
    from kvguard.control.keys import TenantKeys

tenant_key_app = typer.Typer(
    help="Inference API keys for tenants of `kvguard engine serve`.", no_args_is_help=True
)
db_app = typer.Typer(help="The database: migrations and PostgreSQL grants.", no_args_is_help=True)

TenantDbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="KVGUARD_DB_URL",
        help="Tenant registry database URL (default: SQLite under KVGUARD_DATA_DIR).",
        show_default=False,
    ),
]


def resolve_db_url(db: str | None, *, existing: bool = False) -> str:
    """`--db`, or the embedded SQLite default under KVGUARD_DATA_DIR (created). `existing`: for a
    command that works on stored state (revoking, listing, issuing for a registered tenant), a
    SQLite file that does not exist is a ConfigError, not a new database made at a mistyped path."""
    from kvguard.settings import load_settings  # noqa: PLC0415

    if db:
        url = db
    else:
        settings = load_settings()
        settings.data_dir.mkdir(parents=True, exist_ok=True)  # the embedded default lives there
        url = settings.database_url()
    if existing:
        _require_existing(url)
    return url


def _require_existing(url: str) -> None:
    from kvguard.audit.db import missing_sqlite_file, parse_url  # noqa: PLC0415

    if missing_sqlite_file(parse_url(url)):
        raise ConfigError(
            f"database {safe_url(url)} does not exist: check --db (or KVGUARD_DB_URL); "
            "`kvguard db migrate` creates one"
        )


def _submit_recorded_purge(
    queue: CommandQueue,
    selector: PurgeSelector,
    by: str,
    *,
    tenant_tag: Callable[[str], str] | None = None,
) -> tuple[int, int]:
    """Queue the purge and its `purge.create` ledger entry in one transaction (through the outbox:
    the admin API, or the next `kvguard audit checkpoint` / `export`, delivers it).

    The entry records what `POST /v1/purges` records, so the job's erasure certificate verifies
    (`kvguard.audit.certificate`): the requester as the job names it (`cli:<by>`), the engines
    live now (`engines_expected`), a model's or adapter's value digest, and the tenant's `tt_`
    tag (`tenant_tag`: the salt keyring's; without it a tenant or session purge's certificate
    cannot verify). Returns the command id and how many engines were live."""
    from kvguard.audit.certificate import recorded_value  # noqa: PLC0415
    from kvguard.control.engines import (  # noqa: PLC0415
        LIVE_MAX_AGE_S,
        EngineRegistry,
        expected_engines,
    )
    from kvguard.control.outbox import (  # noqa: PLC0415
        operator_event,
        operator_principal,
        record_operator_change,
    )

    tenant = selector.tenant_id or (selector.value if selector.kind.value == "tenant" else None)
    # Counted before the write transaction, as the API counts them (`routes.purges._submit`).
    # (The API's job report uses the same age, `ApiConfig.engine_max_age_s`.) The job is dated at
    # the same instant, so its report waits for exactly these engines.
    now = time.time()
    engines = EngineRegistry(queue.engine).engines()
    expected = len(expected_engines(engines, now, LIVE_MAX_AGE_S))
    command_id = int(
        record_operator_change(
            queue.engine,
            lambda conn: queue.submit_purge(
                selector, requested_by=operator_principal(by), conn=conn, created_at=now
            ),
            lambda job_id: operator_event(
                "purge.create",
                by=by,
                tenant_id=tenant,
                scope_tag=tenant_tag(tenant) if tenant and tenant_tag else None,
                job_id=job_id,
                purge_kind=selector.kind.value,
                engines_expected=expected,
                **recorded_value(selector.kind.value, selector.value),
            ),
        )
    )
    return command_id, expected


def tenant_tagger() -> Callable[[str], str] | None:
    """The tenant-tag function of this process's salt keyring (`KVGUARD_SALT_KEYRING_FILE`,
    `KVGUARD_SALT_KEY`, or in dev mode the one under `KVGUARD_DATA_DIR`, never generated here),
    or None when it has none. A keyring that is configured but unreadable is a ConfigError."""
    from kvguard.isolation.salts import SaltDeriver  # noqa: PLC0415
    from kvguard.settings import Mode, load_settings  # noqa: PLC0415

    settings = load_settings()
    configured = settings.salt_keyring_file is not None or settings.salt_key is not None
    dev = settings.mode is Mode.DEV and (settings.data_dir / "salt.keys").exists()
    if not (configured or dev):
        return None
    return SaltDeriver(settings.load_keyring()).tenant_tag


def _selector(
    tenant: str | None, chosen: list[tuple[str, str]], json_output: bool
) -> PurgeSelector:
    from kvguard.control.commands import PurgeKind, PurgeSelector  # noqa: PLC0415

    if len(chosen) > 1 or (not chosen and not tenant):
        message = "give exactly one of --tenant, --session (with --tenant), --model, --adapter"
        raise fail(message, EXIT_USAGE, json_output)
    too_long = _too_long(tenant, chosen)
    if too_long is not None:
        raise fail(too_long, EXIT_USAGE, json_output)
    from kvguard.control.tenants import check_tenant_id  # noqa: PLC0415

    if tenant is not None:
        try:  # no tenant can have it (the API answers 422): a typo, never a purge of nothing
            check_tenant_id(tenant)
        except ConfigError as exc:
            raise fail(f"--tenant: {exc}", EXIT_USAGE, json_output) from None
    if chosen:
        kind, value = chosen[0]
        if kind != "session" and tenant:
            # Dropping --tenant would purge the model or adapter for every tenant, which is not
            # what was asked for; the API refuses the same request (422).
            message = f"--{kind} purges apply to every tenant; leave --tenant out"
            raise fail(message, EXIT_USAGE, json_output)
        return PurgeSelector(PurgeKind(kind), value, tenant if kind == "session" else None)
    return PurgeSelector(PurgeKind.TENANT, str(tenant))


def _too_long(tenant: str | None, chosen: list[tuple[str, str]]) -> str | None:
    """The problem with an option longer than its column (the API's limits, 422 there), named
    before the database refuses it with a DataError that could name neither option nor column."""
    from kvguard.control.schema import SELECTOR_VALUE_MAX, TENANT_ID_MAX  # noqa: PLC0415

    if tenant is not None and len(tenant) > TENANT_ID_MAX:
        return f"--tenant is longer than {TENANT_ID_MAX} characters"
    for kind, value in chosen:
        if len(value) > SELECTOR_VALUE_MAX:
            return f"--{kind} is longer than {SELECTOR_VALUE_MAX} characters"
    return None


def _wait_for_acks(queue: CommandQueue, command_id: int, wait: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + wait
    while wait and time.monotonic() < deadline:
        acks = queue.acks(command_id)
        if acks:
            return acks
        time.sleep(0.2)
    return []


def purge(  # noqa: PLR0917 (typer maps each parameter to one option)
    db: TenantDbOption = None,
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
    json_output: JsonOpt = False,
) -> None:
    """Queue a purge for every engine on the database; cached blocks are quarantined and zeroized.

    Exit 0 queued (with --wait: and acknowledged, or no engine was live to hold the blocks); 1 no
    engine acknowledged within --wait; 2 usage or environment (selector options, database)."""
    from kvguard.control.commands import CommandQueue  # noqa: PLC0415

    chosen = [
        (k, v) for k, v in (("session", session), ("model", model), ("adapter", adapter)) if v
    ]
    selector = _selector(tenant, chosen, json_output)
    if not 0 <= wait <= MAX_WAIT_S:  # checked before anything is queued (NaN too)
        raise fail(f"--wait must be 0 to {MAX_WAIT_S:g} seconds", EXIT_USAGE, json_output)
    # The database the engines poll (the embedded default, as every command), never a new one at
    # a mistyped path (a purge queued there reaches no engine and exited 0: found by a review).
    db = _resolved(db, json_output)
    with reporting(json_output, db_url=db):
        # Only a tenant or session purge's entry names a tenant (by its tag).
        tagger = tenant_tagger() if selector.kind.value in ("tenant", "session") else None
        queue = CommandQueue.open(db)
        named = selector.value if selector.kind.value == "tenant" else selector.tenant_id
        if named is not None:
            # As the API answers 404: a mistyped tenant id is an erasure of nothing, exit 1.
            from kvguard.control.tenants import TenantRegistry  # noqa: PLC0415

            TenantRegistry(queue.engine).require(named)
        command_id, live = _submit_recorded_purge(queue, selector, by, tenant_tag=tagger)
        if tagger is None and selector.kind.value in ("tenant", "session"):
            typer.echo(NO_TENANT_TAG, err=True)
        result: dict[str, Any] = {
            "command_id": command_id,
            "selector": {
                "kind": selector.kind.value,
                "value": selector.value,
                "tenant_id": selector.tenant_id,
            },
            "acks": [],
            "live_engines": live,
        }
        try:
            # No engine live: none holds the blocks (an engine's cache dies with it), and none
            # would ever acknowledge: waiting only ended in "no engine acknowledged", exit 1.
            result["acks"] = _wait_for_acks(queue, command_id, wait) if live else []
        except KeyboardInterrupt:
            # The purge is committed: say so, or a retry would queue a second one.
            error = "interrupted while waiting for acknowledgements; the purge is queued"
            result.update(interrupted=True, error=error, exit_code=130)
            emit(result, json_output, f"purge command {command_id} queued (wait interrupted)")
            raise typer.Exit(130) from None
    acks = result["acks"]
    if wait and not live:
        typer.echo(
            f"purge command {command_id} queued; no engine was live, so none held these blocks",
            err=True,
        )
    elif wait and not acks:
        message = "no engine acknowledged the purge yet (engines poll when they are busy)"
        if not json_output:
            typer.echo(f"purge command {command_id} queued")
        raise fail(message, EXIT_INVALID, json_output, result=result)
    lines = [f"purge command {command_id} queued"] + [
        f"engine {ack['engine_id']}: {ack['blocks_quarantined']} blocks quarantined" for ack in acks
    ]
    emit(result, json_output, "\n".join(lines))


def _tenant_keys(url: str) -> TenantKeys:
    from kvguard.control.keys import TenantKeys  # noqa: PLC0415

    return TenantKeys.open(url)


def _resolved(db: str | None, json_output: bool, *, existing: bool = True) -> str:
    with reporting(json_output):
        return resolve_db_url(db, existing=existing)


@tenant_key_app.command("create")
def tenant_key_create(
    tenant: Annotated[str, typer.Argument(help="A registered tenant id the key maps to.")],
    db: TenantDbOption = None,
    json_output: JsonOpt = False,
) -> None:
    """Issue an inference API key for a registered tenant (shown once; only its hash is kept).

    Exit 0 ok; 1 the tenant is not registered or is disabled; 2 usage or environment."""
    from kvguard.control.outbox import operator_event, record_operator_change  # noqa: PLC0415

    url = _resolved(db, json_output)
    with reporting(json_output, db_url=url):
        # The tenant's tag where this process has the salt keyring: the entry is then in the
        # tenant's own ledger view, as the API's is (it was in admins' and auditors' only).
        tagger = tenant_tagger()
        keys = _tenant_keys(url)
        issued = record_operator_change(
            keys.engine,
            lambda conn: keys.issue(tenant, conn=conn),
            lambda i: operator_event(
                "inference_key.create",
                tenant_id=tenant,
                scope_tag=tagger(tenant) if tagger else None,
                key_id=i.key_id,
            ),
        )
    human = f"key id {issued.key_id} for tenant {issued.tenant_id} (store it now, it is not kept):"
    result = {
        "key_id": issued.key_id,
        "tenant_id": issued.tenant_id,
        "api_key": issued.api_key,  # printed once on purpose, as the plain output does
    }
    emit(result, json_output, f"{human}\n{issued.api_key}")


@tenant_key_app.command("revoke")
def tenant_key_revoke(
    key_id: Annotated[str, typer.Argument(help="The key id (12 hex digits after kvg_).")],
    db: TenantDbOption = None,
    json_output: JsonOpt = False,
) -> None:
    """Revoke a tenant key; the server refuses it from the next request.

    Exit 0 ok; 1 no such key; 2 usage or environment."""
    from kvguard.control.outbox import operator_event, record_operator_change  # noqa: PLC0415

    url = _resolved(db, json_output)
    with reporting(json_output, db_url=url):
        tagger = tenant_tagger()  # as for `tenant-key create`
        keys = _tenant_keys(url)
        info, revoked_now = record_operator_change(
            keys.engine,
            lambda conn: keys.revoke_once(key_id, conn=conn),
            lambda done: operator_event(
                "inference_key.revoke",
                tenant_id=done[0].tenant_id,
                scope_tag=tagger(done[0].tenant_id) if tagger else None,
                key_id=key_id,
                already_revoked=not done[1],  # a repeat revokes nothing
            ),
        )
    result = {
        "key_id": key_id,
        "tenant_id": info.tenant_id,
        "revoked": True,
        "already_revoked": not revoked_now,
    }
    human = "was already revoked" if not revoked_now else "revoked"
    emit(result, json_output, f"tenant key {key_id} {human}")


@tenant_key_app.command("list")
def tenant_key_list(
    db: TenantDbOption = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    json_output: JsonOpt = False,
) -> None:
    """List tenant keys (id, tenant, created, revoked); never the keys themselves.

    Exit 0 ok; 2 usage or environment."""
    url = _resolved(db, json_output)
    with reporting(json_output, db_url=url):
        rows = _tenant_keys(url).list(tenant)
    lines = [
        f"{r.key_id}  {r.tenant_id}  {r.created_iso}  {'revoked' if r.revoked else 'active'}"
        for r in rows
    ]
    emit({"keys": [r.as_dict() for r in rows]}, json_output, "\n".join(lines))


@db_app.command("migrate")
def db_migrate(
    db: Annotated[str | None, typer.Option(help="Database URL (run as the owner role).")] = None,
    json_output: JsonOpt = False,
) -> None:
    """Create or upgrade every kvguard table (control plane and ledger) to this release's schema.

    Exit 0 ok; 2 usage or environment (a database it cannot open or migrate)."""
    from kvguard.audit import migrate as ledger  # noqa: PLC0415
    from kvguard.audit.db import create_engine  # noqa: PLC0415
    from kvguard.control import db as control  # noqa: PLC0415

    url = _resolved(db, json_output, existing=False)  # creating it is the point
    with reporting(json_output, db_url=url):
        engine = create_engine(url)
        try:
            with progress("migrating", "schemas", json_output=json_output) as update:
                ledger_before = ledger.current_revision(engine)
                ledger.upgrade(engine)
                update(1, 2)
                control_before = control.current_revision(engine)
                control.upgrade(engine)
                update(2, 2)
            ledger_after = ledger.current_revision(engine)
            control_after = control.current_revision(engine)
        finally:
            engine.dispose()
    result = {
        "database": safe_url(url),
        "ledger": {"before": ledger_before, "after": ledger_after},
        "control": {"before": control_before, "after": control_after},
    }
    human = (
        f"ledger schema: {_migration(ledger_before, ledger_after)}\n"
        f"control schema: {_migration(control_before, control_after)}"
    )
    emit(result, json_output, human)


def _migration(before: str | None, after: str | None) -> str:
    """What `db migrate` did to one schema, from its revisions before and after."""
    if before == after:
        return f"already at {after} (up to date)"
    return f"migrated from {before or 'nothing'} to {after}"


@db_app.command("grants")
def db_grants(
    app_role: Annotated[str, typer.Argument(help="The PostgreSQL role serving processes use.")],
    json_output: JsonOpt = False,
) -> None:
    """Print the SQL (run it as the owner role) that gives APP_ROLE what the serving processes need.

    The API, engines and front ends get the ledger append-only and the control tables per
    docs/operations.md. Exit 0 ok; 2 an invalid role name."""
    from kvguard.control.roles import all_grants  # noqa: PLC0415

    with reporting(json_output, usage=(ValueError,)):
        statements = all_grants(app_role)
    result = {"role": app_role, "statements": statements}
    emit(result, json_output, "\n".join(f"{statement};" for statement in statements))
