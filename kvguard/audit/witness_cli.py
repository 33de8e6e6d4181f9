"""Command-line entry points of the witness, as Typer pieces for `kvguard.cli` to mount:

- `witness_app`: `kvguard witness serve --key WITNESS_KEY_FILE --log ORIGIN=VKEY [--log ...]
  --state STATE.db [--listen HOST:PORT]` runs a c2sp.org/tlog-witness (`kvguard.audit.witness`);
- `witness_key_command`: `kvguard keys witness-key NAME --out PATH` creates a witness key (0600) and
  prints its verifier key, which relying parties pass to `require_cosignatures`.

`--log ORIGIN=VKEY` trusts the log verifier key VKEY for checkpoints whose origin line is ORIGIN; a
bare `--log VKEY` uses the key's name as the origin (the common convention). Repeat `--log` for more
logs, or for a second key of one log during a rotation. Exit codes (`kvguard.cli_output`, docs/cli.md):
0 ok, 2 usage or environment (a bad option, an unreadable key or state file, an address it cannot
listen on).
"""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path
from types import FrameType
from typing import Annotated, Final

import typer

from kvguard.audit import note
from kvguard.audit.cli import create_note_key
from kvguard.audit.cosign import WitnessKey
from kvguard.cli_output import EXIT_USAGE, JsonOpt, fail
from kvguard.errors import KvguardError, VerificationError

witness_app = typer.Typer(
    help="Transparency-log witness (c2sp.org/tlog-witness) for kvguard ledgers.",
    no_args_is_help=True,
)


LOG_OPTION_FORM: Final = (
    "--log takes ORIGIN=VKEY, or a bare VKEY whose name is the origin; VKEY is the log's verifier "
    "key, NAME+KEYID+BASE64KEY as `kvguard keys verifier-key LOG_SIGNING_KEY_FILE` prints it"
)


def parse_log_option(value: str) -> tuple[str, note.Verifier]:
    """`ORIGIN=VKEY` or a bare `VKEY` (origin = key name) -> (origin, verifier).

    A vkey's name never contains `+` and its base64 may end in `=`, so `=` before the first `+`
    separates an origin; origins containing `=` are not supported.
    """
    origin, sep, vkey = value.partition("=")
    if not sep or "+" in origin:
        origin, vkey = "", value
    if "+" not in vkey:  # `--log ORIGIN`, `--log ORIGIN=`: the key left out
        raise ValueError(f"{LOG_OPTION_FORM}; this one has no verifier key")
    try:
        verifier = note.parse_verifier_key(vkey, what="its verifier key")
    except VerificationError as exc:  # never echoed: a private key pasted by mistake is a secret
        raise ValueError(f"{LOG_OPTION_FORM}; {exc}") from None
    origin = origin or verifier.name
    if "\n" in origin or not origin.strip():
        raise ValueError("a log origin is one non-empty line")
    return origin, verifier


def parse_listen(value: str) -> tuple[str, int]:
    """`HOST:PORT` or `[IPv6]:PORT`; port 0 picks a free port (printed once listening)."""
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, not {value!r}")
    return host.removeprefix("[").removesuffix("]") or "127.0.0.1", int(port)


def _stop(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)  # unwinds serve_forever so the socket and the state file are closed


@witness_app.command("serve")
def serve_command(
    key: Annotated[Path, typer.Option("--key", help="Witness key file (0600)")],
    log: Annotated[
        list[str],
        typer.Option(
            "--log",
            help="ORIGIN=VKEY of a log to witness, or a bare VKEY (its name is the origin); VKEY "
            "as `kvguard keys verifier-key` prints it (repeatable)",
        ),
    ],
    state: Annotated[Path, typer.Option("--state", help="Witness state file (SQLite, 0600)")],
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to bind")] = "127.0.0.1:8650",
    new_state: Annotated[
        bool,
        typer.Option(
            "--new-state", help="Create the state file (refused if it exists): a new witness"
        ),
    ] = False,
) -> None:
    """Serve POST /add-checkpoint: cosign checkpoints that extend what this witness saw.

    The state file must exist unless --new-state creates it: a witness whose state is gone would
    cosign any history, a rewritten one included. Exit 0 when stopped (SIGTERM or Ctrl-C); 1 it
    failed while serving; 2 usage or environment (key, state file, listen address):
    docs/operations.md, "Exit codes of the servers"."""
    from kvguard.audit.witness import Witness, WitnessState, serve  # noqa: PLC0415

    try:
        host, port = parse_listen(listen)
        logs: dict[str, list[note.Verifier]] = {}
        for value in log:
            origin, verifier = parse_log_option(value)
            logs.setdefault(origin, []).append(verifier)
        witness_key = WitnessKey.load(key)
    except (KvguardError, ValueError, OSError) as exc:
        raise fail(str(exc), EXIT_USAGE, label="usage error") from None
    if new_state and state.exists():
        raise fail(f"--new-state: {state} exists (a witness's state is never replaced)", EXIT_USAGE)
    if not new_state and not state.exists():
        # Started fresh, a witness holds no size for any log and cosigns whatever it is sent:
        # the rollback and fork protection it exists for would be gone without a word.
        raise fail(
            f"witness state {state} does not exist: a witness that lost its state would cosign "
            "any history; start a new witness with --new-state",
            EXIT_USAGE,
        )
    try:
        witness_state = WitnessState(state)
    except (KvguardError, sqlite3.Error, OSError) as exc:
        raise fail(f"cannot open witness state {state}: {exc}", EXIT_USAGE) from None
    witness = Witness(witness_key, logs, witness_state)
    listened: list[bool] = []

    def listening(bound_host: str, bound_port: int) -> None:
        listened.append(True)
        typer.echo(
            f"witness {witness_key.name} listening on http://{bound_host}:{bound_port} "
            f"for {len(logs)} log(s): {', '.join(sorted(logs))}"
        )

    # Both stop signals explicitly: a process started with SIGINT ignored (a background job of a
    # non-interactive shell, some supervisors) gets no KeyboardInterrupt from Python and would
    # never stop on Ctrl-C or `kill -INT` (found by the exit-code tests run that way).
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        serve(witness, host, port, on_listening=listening)
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        if new_state and not listened:
            # A new witness that never served: its fresh state goes, so that the same command
            # (with --new-state) can be run again (found by a re-test: it then said "exists").
            witness_state.close()
            for leftover in (state, *state.parent.glob(f"{state.name}-*")):
                leftover.unlink(missing_ok=True)
        raise fail(f"cannot listen on {listen}: {exc}", EXIT_USAGE) from None
    finally:
        witness_state.close()


def witness_key_command(
    name: Annotated[str, typer.Argument(help="Witness name, e.g. witness.example.com/w1")],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Private key file to create (mode 0600); default: witness.key in KVGUARD_DATA_DIR",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Create a witness cosigning key (0600) and print its verifier key.

    Exit 0 ok; 2 the name is invalid or the file exists (never overwritten)."""
    create_note_key(WitnessKey, name, out, "witness.key", json_output)
