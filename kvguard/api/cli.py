"""`kvguard serve` and `kvguard keys create|revoke` (admin API keys).

Exit codes follow `kvguard.cli_output` (docs/cli.md): 0 ok, 1 the key named does not exist (or is
already revoked), 2 usage or environment (a bad option, missing secrets, a database it cannot open).
`kvguard serve` ends as every server does (docs/operations.md, "Exit codes of the servers"): 0 when
stopped by a signal, 1 when it failed, 2 usage or environment.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Sequence
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer

from kvguard.cli_output import EXIT_FAILED, EXIT_USAGE, JsonOpt, emit, fail, reporting, safe_url
from kvguard.errors import ConfigError, VerificationError
from kvguard.logging import capture_stdlib_logging, export_server_logging

if TYPE_CHECKING:
    import sqlalchemy as sa

    from kvguard.api.auth import ApiKeys
    from kvguard.api.services import ApiConfig
    from kvguard.control.keys import IssuedApiKey

MIN_CHECKPOINT_INTERVAL_S: Final = 1.0
MAX_CHECKPOINT_INTERVAL_S: Final = 86_400.0  # a day; `threading.Event.wait` overflows far beyond

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="KVGUARD_DB_URL",
        help="Database URL (default: SQLite under KVGUARD_DATA_DIR).",
        show_default=False,
    ),
]


def _open_keys(url: str) -> ApiKeys:
    from kvguard.api.auth import ApiKeys  # noqa: PLC0415
    from kvguard.audit.db import create_engine  # noqa: PLC0415

    return ApiKeys(create_engine(url))


def serve_command(  # noqa: PLR0917 (typer maps each parameter to one option)
    db: DbOption = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.", min=0, max=65535)] = 8600,
    origin: Annotated[
        str | None,
        typer.Option(
            envvar="KVGUARD_LEDGER_ORIGIN",
            help="Ledger checkpoint origin line; default: kvguard.local/ledger.",
            show_default=False,
        ),
    ] = None,
    checkpoint_interval: Annotated[
        float,
        typer.Option(
            help=f"Seconds between periodic checkpoints, {MIN_CHECKPOINT_INTERVAL_S:g} to "
            f"{MAX_CHECKPOINT_INTERVAL_S:g} (0: on demand only)."
        ),
    ] = 60.0,
    max_body_bytes: Annotated[
        int,
        typer.Option(min=1, help="Largest request body accepted; larger ones get 413 unread."),
    ] = 1 << 20,
    trusted_proxy: Annotated[
        list[str] | None,
        typer.Option(
            help="Address of a reverse proxy whose X-Forwarded-For / X-Forwarded-Proto headers "
            "are believed (repeat for several; default: none, headers are ignored).",
            show_default=False,
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="Worker processes (each opens its own connections; the outbox and checkpoints "
            "are safe to share).",
        ),
    ] = 1,
    witness: Annotated[
        list[str] | None,
        typer.Option(
            envvar="KVGUARD_LEDGER_WITNESSES",
            help="A c2sp.org/tlog-witness that cosigns every checkpoint, as URL=VERIFIER_KEY "
            "(repeat for several).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve the compliance admin API (uvicorn).

    Secrets: KVGUARD_SIGNING_KEY_FILE and KVGUARD_SALT_KEYRING_FILE (0600 files), or
    KVGUARD_MODE=dev to generate them under KVGUARD_DATA_DIR. Exit 0 when stopped (SIGTERM or
    Ctrl-C); 1 the ledger fails its start-up check, or the server fails (a worker process cannot
    start, which stops them all); 2 usage or environment (missing secrets, a database it cannot
    open, an address it cannot listen on)."""
    from kvguard.api.app import create_app  # noqa: PLC0415
    from kvguard.api.services import CONFIG_ENV, Services  # noqa: PLC0415
    from kvguard.audit.witness_client import WitnessEndpoint  # noqa: PLC0415

    if not _valid_checkpoint_interval(checkpoint_interval):
        message = (
            f"--checkpoint-interval must be 0 (on demand only) or {MIN_CHECKPOINT_INTERVAL_S:g} "
            f"to {MAX_CHECKPOINT_INTERVAL_S:g} seconds"
        )
        raise fail(message, EXIT_USAGE)
    with reporting(False, usage=(ValueError,)):
        config = _config(db, origin, checkpoint_interval or None, max_body_bytes)
        config = replace(config, witnesses=tuple(witness or ()))
        for w in config.witnesses:
            try:
                WitnessEndpoint.parse(w)
            except VerificationError as exc:  # a malformed option (exit 2), not an invalid log
                raise ConfigError(f"--witness: {exc}") from None
    with reporting(False, db_url=config.db_url):
        services = Services.open(config)
    problem = _bind_problem(host, port)
    if problem is not None:  # before the banner: a port in use read as a server that came up
        services.close()
        raise fail(f"cannot serve on {_address(host, port)}: {problem}", EXIT_USAGE)
    typer.echo(
        f"kvguard admin API on http://{_address(host, port)} (database {safe_url(config.db_url)})"
    )
    capture_stdlib_logging()  # uvicorn's own lines: structlog JSON with kvguard's redaction
    if workers > 1:
        # Checked above in this process (secrets, database, migrations); each worker opens its
        # own services from the same settings.
        services.close()
        os.environ[CONFIG_ENV] = config.to_json()
        export_server_logging()  # the workers log as this process does (access lines at INFO)
        run_uvicorn(
            "kvguard.api.app:app_from_environment",
            factory=True,
            workers=workers,
            host=host,
            port=port,
            **uvicorn_options(trusted_proxy or []),
        )
        return
    run_uvicorn(
        create_app(services, close_on_shutdown=True, freeze_heap=True),
        host=host,
        port=port,
        **uvicorn_options(trusted_proxy or []),
    )


def _valid_checkpoint_interval(seconds: float) -> bool:
    # A negative (or NaN) wait returns at once and the checkpoint thread spins; an infinite or huge
    # one overflows the thread's timed wait. Below a second, signing would be most of the work.
    return seconds == 0 or MIN_CHECKPOINT_INTERVAL_S <= seconds <= MAX_CHECKPOINT_INTERVAL_S


def run_uvicorn(app: Any, *, host: str, port: int, **options: Any) -> None:
    """`uvicorn.run`, its ends mapped to the servers' exit codes (docs/operations.md, "Exit codes
    of the servers"):

    - stopped by SIGTERM (systemd, Docker, Kubernetes) or Ctrl-C after a graceful shutdown:
      returns (exit 0). uvicorn re-raises a signal it caught once it has shut down, with the
      handler that was installed before it ran; that handler is `_stopped`, which exits 0, instead
      of the default one, which would kill the process (status 143);
    - could not start: uvicorn logs the cause and exits 3. Exit 2 when the address cannot be
      bound (in use, a host that does not resolve: checked again here, uvicorn exits 3 for any
      start-up failure), else 1: the application failed to start;
    - with workers, a worker that fails to start (it cannot open its database, say; also the
      replacement of a worker that died) makes uvicorn's supervisor log an error and stop every
      worker, and `uvicorn.run` then returns as after a signal: exit 1."""
    import uvicorn  # noqa: PLC0415

    supervisor = _SupervisorErrors()
    uvicorn_log = logging.getLogger("uvicorn.error")
    workers = int(options.get("workers") or 1)
    previous = {sig: _on_signal(sig, _stopped) for sig in _STOP_SIGNALS}
    if workers > 1:
        uvicorn_log.addHandler(supervisor)
    try:
        uvicorn.run(app, host=host, port=port, **options)
    except SystemExit as exc:
        if exc.code in {0, None}:
            return
        problem = _bind_problem(host, port)  # taken since the check before the banner
        if problem is not None:
            raise fail(f"cannot serve on {_address(host, port)}: {problem}", EXIT_USAGE) from None
        raise fail(_FAILED, EXIT_FAILED) from None
    finally:
        uvicorn_log.removeHandler(supervisor)
        for sig, handler in previous.items():
            _on_signal(sig, handler)
    if supervisor.errors:
        raise fail(_FAILED, EXIT_FAILED)


_FAILED: Final = (
    "the server failed: the application or a worker process could not start (the log lines "
    "above say why); exit 1 so that a supervisor restarts it"
)
_STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


class _SupervisorErrors(logging.Handler):
    """Counts the errors uvicorn's worker supervisor logs in this process. It logs one when it
    stops every worker because one failed to start, and returns as if it had been signalled."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.errors += 1


def _bind_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be served (in use, a host that does not resolve), or None. Probes
    every address the host resolves to, as uvicorn's server binds them (one socket each, IPv6 ones
    IPv6-only, SO_REUSEADDR: a port a server listens on is refused, one in TIME_WAIT is not), and
    closes the probes: uvicorn binds for real afterwards (a port taken in between is exit 2 too)."""
    try:
        addresses = socket.getaddrinfo(
            host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except (OSError, UnicodeError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                return exc.strerror or str(exc)
    return None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _stopped(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def _on_signal(sig: int, handler: Any) -> Any:
    """Install `handler` for `sig` and return the one it replaces (None off the main thread,
    where signals cannot be handled, and where nothing is installed)."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(sig, handler)


def uvicorn_options(trusted_proxies: Sequence[str]) -> dict[str, Any]:
    """uvicorn settings of `kvguard serve`. Forwarded headers are believed only from the configured
    proxies: uvicorn's own default believes `X-Forwarded-For` from 127.0.0.1, so a caller on the
    host (or behind a proxy there) could name a new client address on every request and never reach
    the failed-authentication limit."""
    from kvguard.api.http_protocol import http_options  # noqa: PLC0415

    return {
        "proxy_headers": bool(trusted_proxies),
        "forwarded_allow_ips": ",".join(trusted_proxies),
        "access_log": False,  # kvguard.api.app.AccessLog writes one line per request
        "log_config": None,  # keep the handlers capture_stdlib_logging installed
        # Request heads bounded in size and time (kvguard.api.http_protocol).
        **http_options(),
    }


def _config(
    db: str | None, origin: str | None, checkpoint_interval: float | None, max_body_bytes: int
) -> ApiConfig:
    from kvguard.api.services import ApiConfig  # noqa: PLC0415
    from kvguard.settings import load_settings  # noqa: PLC0415

    settings = load_settings()
    origin = origin or settings.ledger_origin
    keyring_file, signing_file = settings.secret_files(origin, command="kvguard serve")
    return ApiConfig(
        db_url=db or settings.database_url(),
        signing_key_file=signing_file,
        more_signing_key_files=tuple(settings.signing_key_files()[1:]),  # during a rotation
        salt_keyring_file=keyring_file,
        origin=origin,
        checkpoint_interval_s=checkpoint_interval,
        max_body_bytes=max_body_bytes,
    )


def create_key_command(
    role: Annotated[str, typer.Option(help="admin, auditor or tenant_admin.")],
    db: DbOption = None,
    tenant: Annotated[
        str | None, typer.Option(help="The tenant a tenant_admin key is bound to.")
    ] = None,
    label: Annotated[str, typer.Option(help="A note kept with the key (not secret).")] = "",
    json_output: JsonOpt = False,
) -> None:
    """Create an admin API key; it is printed once and only a keyed hash of it is kept.

    Exit 0 ok; 1 --tenant names no registered tenant; 2 usage or environment (role, --tenant,
    database: a `--db` SQLite file that does not exist is refused, not created)."""
    from kvguard.api.auth import Role  # noqa: PLC0415
    from kvguard.control.cli import resolve_db_url, tenant_tagger  # noqa: PLC0415
    from kvguard.control.outbox import operator_event, record_operator_change  # noqa: PLC0415
    from kvguard.control.tenants import TenantRegistry  # noqa: PLC0415

    try:
        chosen = Role(role)
    except ValueError:
        roles = ", ".join(r.value for r in Role)
        raise fail(f"--role must be one of {roles}", EXIT_USAGE, json_output) from None
    with reporting(json_output):
        # The embedded default is created on first use (the README's first command); a database
        # named with --db is not: a mistyped path would get a key no server ever reads.
        url = resolve_db_url(db, existing=db is not None)
    with reporting(json_output, db_url=url):
        keys = _open_keys(url)
        # A tenant_admin key's entry names its tenant's tag where this process has the salt
        # keyring, so that it is in the tenant's own ledger view, as the API's is.
        tagger = tenant_tagger() if tenant is not None else None

        def create(conn: sa.Connection) -> IssuedApiKey:
            if tenant is not None and chosen is Role.TENANT_ADMIN:
                # A key bound to an id no tenant has yet would govern whichever tenant is later
                # registered under it (a typo today, someone else's tenant tomorrow).
                TenantRegistry(keys.engine).get(tenant, conn=conn)
            return keys.create(chosen, tenant_id=tenant, label=label, conn=conn)

        issued = record_operator_change(
            keys.engine,
            create,
            lambda i: operator_event(
                "api_key.create",
                tenant_id=tenant,
                scope_tag=tagger(tenant) if tagger and tenant else None,
                key_id=i.principal.key_id,
                granted_role=chosen.value,
            ),
        )
    bound = f" for tenant {tenant}" if tenant else ""
    human = f"{chosen.value} key {issued.principal.key_id}{bound} (shown once, store it now):"
    result = {
        "key_id": issued.principal.key_id,
        "role": chosen.value,
        "tenant_id": tenant,
        "label": label,
        "api_key": issued.api_key,  # printed once on purpose, as the plain output does
    }
    emit(result, json_output, f"{human}\n{issued.api_key}")


def revoke_key_command(
    key_id: Annotated[str, typer.Argument(help="The key id (the 12 hex digits after kvg_adm_).")],
    db: DbOption = None,
    json_output: JsonOpt = False,
) -> None:
    """Revoke an admin API key; every API process refuses it from its next request.

    Exit 0 ok; 1 no active key with that id; 2 usage or environment (database)."""
    from kvguard.control.cli import resolve_db_url  # noqa: PLC0415
    from kvguard.control.outbox import operator_event, record_operator_change  # noqa: PLC0415

    with reporting(json_output):
        url = resolve_db_url(db, existing=True)
    with reporting(json_output, db_url=url):
        keys = _open_keys(url)
        record_operator_change(
            keys.engine,
            lambda conn: keys.revoke(key_id, conn=conn),
            lambda _none: operator_event("api_key.revoke", key_id=key_id),
        )
        keys.settle(key_id)  # returns once no API process takes the key from its cache
    emit({"key_id": key_id, "revoked": True}, json_output, f"key {key_id} revoked")
