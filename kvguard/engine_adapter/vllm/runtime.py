"""The kvguard objects an engine process needs, built from `kv_connector_extra_config`.

Keys (all paths absolute or relative to the engine's working directory):

| key | meaning | default |
|---|---|---|
| `salt_keyring_file` | salt keyring (0600) shared with the front end | required (G7) |
| `policy_file` | policy set (YAML/JSON) | built-in secure defaults |
| `ledger_url` | audit ledger database URL | required (G7) |
| `signing_key_file` | checkpoint signing key (0600) | required with `ledger_url` |
| `more_signing_key_files` | other signing key files during a rotation (each signs) | `[]` |
| `ledger_origin` | checkpoint origin line | `kvguard.local/ledger` |
| `ledger_overflow` | `block` or `fail_closed` (the step loop never waits under either: docs/vllm.md) | `fail_closed` |
| `ledger_commit_interval_s` | seconds between the ledger writer's group commits: longer means fewer commits (less CPU taken from the engine) and more entries lost if the process is killed | `0.05` |
| `ledger_writer_nice` | CPU priority of the ledger writer's thread, a Linux nice value 0-19: higher leaves a CPU engine's forward passes the cores, and makes entries, flushes and the ledger's head lock wait while the host is saturated (docs/vllm.md) | `0` |
| `verify_override` | force `none`/`sample`/`full` for every zeroization (tests, benchmarks) | per policy |
| `commands_url` | control database: commands (`kvguard purge`, the admin API), engine registry and cache statistics (`kvguard.control.engines`) | `ledger_url` |
| `policy_url` | policy store database (`kvguard.policy.store`): the engine starts with its current version and follows `policy` commands | unset: `policy_file` only |
| `offload_bytes` | byte budget of the encrypted offload tier (docs/offload.md); 0: no tier | 0 |
| `offload_dir` | directory for tier entries of tenants whose policy allows `offload.disk` | unset: memory only |
| `offload_restore_us_per_block` | restore cost per block for the restore-or-recompute decision | measured by the worker at start |
| `offload_prefill_us_per_token` | prefill cost per token for that decision | measured from the engine's steps |
| `canary` | test-only: check every block entering a new scope is all-zero before the forward, and the custody invariant (G4) after every step | false |

Database URLs reach the engine without their passwords (vLLM logs this configuration at start):
`GuardOptions.to_extra_config` puts them in the environment variable `KVGUARD_ENGINE_DB_PASSWORDS`,
which vLLM's engine processes inherit. A configuration written by hand can leave the password out of
the URL and let libpq find it (`PGPASSWORD`, `~/.pgpass`).

With `policy_url`, the store's current version wins over `policy_file`; the file (or the defaults) is
used only while the store holds no version yet, and the log says which was loaded. A store that cannot
be read refuses start (G7).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, overload

from kvguard.audit.db import parse_url
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.audit.writer import MAX_NICE, check_nice
from kvguard.cli_output import SECRET_PARAMETER
from kvguard.control.policy_seed import seed_from_file
from kvguard.errors import ConfigError, FailClosedError
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.salts import SaltDeriver
from kvguard.logging import get_logger
from kvguard.policy import PolicySet, load_policy_file
from kvguard.policy.store import PolicyStore

DEFAULT_ORIGIN = "kvguard.local/ledger"
_log = get_logger("vllm.runtime")
DEFAULT_COMMIT_INTERVAL_S: Final = 0.05
MAX_COMMIT_INTERVAL_S: Final = 5.0
# The engine's ledger writer keeps the engine's CPU priority unless told otherwise: at 19 it yields
# the cores to a CPU engine's forward passes, but on a saturated host its flushes and the ledger's
# head lock then wait seconds (docs/vllm.md, docs/benchmarks.md, issue 10).
DEFAULT_WRITER_NICE: Final = 0


# The URLs in `kv_connector_extra_config` as given, by URL without its password (JSON).
DB_PASSWORDS_ENV: Final = "KVGUARD_ENGINE_DB_PASSWORDS"


def _keep_password(url: str, passwords: dict[str, str]) -> str:
    """`url` without its password (user information and secret query parameters); the whole URL
    goes into `passwords` under the URL it leaves. ConfigError for what is not a URL (or hides part
    of its password in the host): vLLM would print it whole."""
    parsed = parse_url(url)
    secret = [name for name in parsed.query if SECRET_PARAMETER.search(name)]  # as safe_url masks
    if parsed.password is None and not secret:
        return url
    bare_url = parsed._replace(password=None).difference_update_query(secret)  # (set() keeps it)
    bare = bare_url.render_as_string(hide_password=False)
    passwords[bare] = parsed.render_as_string(hide_password=False)
    return bare


def _passwords() -> dict[str, str]:
    try:
        found = json.loads(os.environ.get(DB_PASSWORDS_ENV) or "{}")
    except ValueError:
        raise ConfigError(f"{DB_PASSWORDS_ENV} is not the JSON kvguard writes") from None
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise ConfigError(f"{DB_PASSWORDS_ENV} is not the JSON kvguard writes")
    return found


@overload
def _with_password(url: str, passwords: dict[str, str]) -> str: ...
@overload
def _with_password(url: str | None, passwords: dict[str, str]) -> str | None: ...
def _with_password(url: str | None, passwords: dict[str, str]) -> str | None:
    """`url` as it was before `to_extra_config` took its password out, if it took one."""
    if url is None or url not in passwords:
        return url
    return passwords[url]


@dataclass(frozen=True, slots=True)
class GuardOptions:
    salt_keyring_file: Path
    ledger_url: str
    signing_key_file: Path
    policy_file: Path | None = None
    # During a signing-key rotation, the other key(s): each checkpoint carries every signature.
    more_signing_key_files: tuple[Path, ...] = ()
    ledger_origin: str = DEFAULT_ORIGIN
    ledger_overflow: str = "fail_closed"
    ledger_commit_interval_s: float = DEFAULT_COMMIT_INTERVAL_S
    ledger_writer_nice: int = DEFAULT_WRITER_NICE
    verify_override: str | None = None
    canary: bool = False
    commands_url: str | None = None
    policy_url: str | None = None
    offload_bytes: int = 0
    offload_dir: str | None = None
    offload_restore_us_per_block: float | None = None
    offload_prefill_us_per_token: float | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> GuardOptions:
        missing = [
            k for k in ("salt_keyring_file", "ledger_url", "signing_key_file") if not extra.get(k)
        ]
        if missing:
            raise FailClosedError(
                "kvguard connector refuses to start: kv_connector_extra_config lacks "
                + ", ".join(missing)
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}"
            )
        passwords = _passwords()
        return cls(
            salt_keyring_file=Path(extra["salt_keyring_file"]),
            ledger_url=_with_password(str(extra["ledger_url"]), passwords),
            signing_key_file=Path(extra["signing_key_file"]),
            more_signing_key_files=_paths(extra, "more_signing_key_files"),
            policy_file=Path(extra["policy_file"]) if extra.get("policy_file") else None,
            ledger_origin=str(extra.get("ledger_origin", DEFAULT_ORIGIN)),
            ledger_overflow=str(extra.get("ledger_overflow", "fail_closed")),
            ledger_commit_interval_s=_commit_interval(extra),
            ledger_writer_nice=_writer_nice(extra),
            verify_override=extra.get("verify_override"),
            canary=bool(extra.get("canary", False)),
            commands_url=_with_password(extra.get("commands_url"), passwords),
            policy_url=_with_password(extra.get("policy_url"), passwords),
            offload_bytes=_non_negative_int(extra, "offload_bytes"),
            offload_dir=str(extra["offload_dir"]) if extra.get("offload_dir") else None,
            offload_restore_us_per_block=_positive_float(extra, "offload_restore_us_per_block"),
            offload_prefill_us_per_token=_positive_float(extra, "offload_prefill_us_per_token"),
        )

    def to_extra_config(self) -> dict[str, Any]:
        """The connector's `kv_connector_extra_config`. vLLM logs it (`vllm serve` prints its
        non-default arguments at start), so database URLs go without their passwords: those are
        put in this process's environment (`DB_PASSWORDS_ENV`), which vLLM's engine processes
        inherit and `from_extra_config` reads back."""
        passwords: dict[str, str] = {}
        out: dict[str, Any] = {
            "salt_keyring_file": str(self.salt_keyring_file),
            "ledger_url": _keep_password(self.ledger_url, passwords),
            "signing_key_file": str(self.signing_key_file),
            "ledger_origin": self.ledger_origin,
            "more_signing_key_files": [str(p) for p in self.more_signing_key_files],
            "ledger_overflow": self.ledger_overflow,
            "ledger_commit_interval_s": self.ledger_commit_interval_s,
            "ledger_writer_nice": self.ledger_writer_nice,
            "canary": self.canary,
        }
        if self.policy_file is not None:
            out["policy_file"] = str(self.policy_file)
        if self.verify_override is not None:
            out["verify_override"] = self.verify_override
        if self.commands_url is not None:
            out["commands_url"] = _keep_password(self.commands_url, passwords)
        if self.policy_url is not None:
            out["policy_url"] = _keep_password(self.policy_url, passwords)
        if passwords:
            os.environ[DB_PASSWORDS_ENV] = json.dumps(passwords)
        for name in (
            "offload_bytes",
            "offload_dir",
            "offload_restore_us_per_block",
            "offload_prefill_us_per_token",
        ):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out

    def deriver(self) -> SaltDeriver:
        return SaltDeriver(Keyring.load(self.salt_keyring_file))

    @property
    def control_url(self) -> str:
        """The database of commands and the engine registry."""
        return self.commands_url or self.ledger_url

    def policy_set(self) -> PolicySet:
        return self.initial_policy()[0]

    def initial_policy(
        self, ledger: Ledger | None = None, *, store: PolicyStore | None = None
    ) -> tuple[PolicySet, int | None]:
        """The policy to start with, and its store version (None: from `policy_file` or defaults).

        With `policy_url` and a `ledger`, an empty store is first seeded from `policy_file`
        (`kvguard.control.policy_seed`), so the engine and the admin API read one policy. `store` is
        the engine link's policy store; without it one is opened for the call."""
        if self.policy_url:
            own = store is None
            store = store or PolicyStore.open(self.policy_url)
            try:
                if ledger is not None:
                    seed_from_file(store, ledger, self.policy_file)
                current = store.current()
            finally:
                if own:
                    store.engine.dispose()
            if current is not None:
                _log.info("policy loaded from the policy store", version=current.change.version)
                return current.policy, current.change.version
            _log.info(
                "the policy store holds no version yet; using the policy file or the defaults",
                source="file" if self.policy_file else "defaults",
            )
        return (load_policy_file(self.policy_file) if self.policy_file else PolicySet()), None

    def open_ledger(self) -> Ledger:
        return Ledger.open(
            self.ledger_url,
            origin=self.ledger_origin,
            signing_key=[
                SigningKey.load(path)
                for path in (self.signing_key_file, *self.more_signing_key_files)
            ],
            overflow=self.ledger_overflow,
            batch_interval=self.ledger_commit_interval_s,
            writer_nice=self.ledger_writer_nice,
        )


def _paths(extra: dict[str, Any], name: str) -> tuple[Path, ...]:
    value = extra.get(name) or []
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"kv_connector_extra_config.{name}: expected a list of file paths")
    return tuple(Path(p) for p in value)


def _non_negative_int(extra: dict[str, Any], name: str) -> int:
    value = extra.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"kv_connector_extra_config.{name}: expected a whole number >= 0")
    return value


def _commit_interval(extra: dict[str, Any]) -> float:
    value = _positive_float(extra, "ledger_commit_interval_s")
    if value is None:
        return DEFAULT_COMMIT_INTERVAL_S
    if value > MAX_COMMIT_INTERVAL_S:
        raise ConfigError(
            f"kv_connector_extra_config.ledger_commit_interval_s: {value} s is more than "
            f"{MAX_COMMIT_INTERVAL_S} s of entries an engine crash could lose"
        )
    return value


def _writer_nice(extra: dict[str, Any]) -> int:
    value = extra.get("ledger_writer_nice", DEFAULT_WRITER_NICE)
    try:
        check_nice(value)
    except ValueError:
        raise ConfigError(
            f"kv_connector_extra_config.ledger_writer_nice: expected a whole number 0-{MAX_NICE} "
            "(a Linux nice value; 0 keeps the engine's priority)"
        ) from None
    return int(value)


def _positive_float(extra: dict[str, Any], name: str) -> float | None:
    value = extra.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"kv_connector_extra_config.{name}: expected a number > 0")
    return float(value)
