"""Process settings (`KVGUARD_*` environment variables) and secret loading.

Secrets come from a 0600 file (preferred) or from an environment variable; a group- or world-readable
secret file is refused. Outside the explicit `dev` mode a missing salt key is fatal (G7, fail closed):
kvguard never serves with an ephemeral or default secret in production. In `dev` mode a keyring is
generated once under the data directory (mode 0600) and a warning is logged.
"""

from __future__ import annotations

import base64
import binascii
import os
from enum import StrEnum
from pathlib import Path

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvguard.errors import ConfigError, FailClosedError
from kvguard.isolation.keyring import Keyring
from kvguard.logging import get_logger, register_secret

_log = get_logger("settings")


class Mode(StrEnum):
    PROD = "prod"
    DEV = "dev"


class Settings(BaseSettings):
    """Everything a kvguard process reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="KVGUARD_", extra="ignore")

    mode: Mode = Mode.PROD
    data_dir: Path = Path("kvguard-data")
    db_url: str | None = None
    salt_keyring_file: Path | None = None
    # A single base64 key from the environment (key id `env`). A file is preferred: environments leak
    # into child processes and crash dumps.
    salt_key: SecretStr | None = None
    signing_key_file: Path | None = None
    # The ledger's checkpoint origin line: every command that signs or checks checkpoints reads it
    # (`kvguard serve`, `kvguard engine serve`, `kvguard audit *`).
    ledger_origin: str = "kvguard.local/ledger"
    policy_file: Path | None = None
    # The engine's encrypted offload tier (`kvguard engine serve`, docs/offload.md): byte budget
    # (0: no tier) and an optional directory for tenants whose policy allows `offload.disk`.
    offload_bytes: int = Field(default=0, ge=0)
    offload_dir: Path | None = None
    # The engine's ledger writer thread's CPU priority, a Linux nice value (`kvguard engine serve`,
    # engine option `ledger_writer_nice`, docs/vllm.md).
    ledger_writer_nice: int = Field(default=0, ge=0, le=19)
    # Logging is the CLI's (`--log-level` / KVGUARD_LOG_LEVEL, kvguard.cli): one variable, read once.

    def database_url(self) -> str:
        """The configured database URL, or an embedded SQLite file under the data directory."""
        if self.db_url:
            return self.db_url
        return f"sqlite:///{(self.data_dir / 'kvguard.db').resolve()}"

    def signing_key_files(self) -> list[Path]:
        """`KVGUARD_SIGNING_KEY_FILE`, else the data directory's `ledger-signing.key` (what
        `kvguard keys signing-key` writes and `kvguard serve` generates in dev mode).

        During a key rotation the variable names both files, separated like PATH entries
        (`old.key:new.key`, `os.pathsep`): every checkpoint then carries both signatures, so
        auditors holding either verifier key accept it (docs/operations.md, Secrets)."""
        if self.signing_key_file is None:
            return [self.data_dir / "ledger-signing.key"]
        return [Path(p) for p in str(self.signing_key_file).split(os.pathsep) if p]

    def secret_path(self, name: str) -> Path:
        """Where a key command writes `name` when no `--out` is given: the data directory (created
        0700), never the working tree (issue 13, item 2). The names match what `kvguard serve`
        generates in dev mode and reads through `KVGUARD_*_FILE`."""
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.data_dir / name

    def secret_files(self, origin: str, *, command: str) -> tuple[Path, Path]:
        """(salt keyring file, checkpoint signing key file) for a server process. In dev mode the
        missing ones are generated under the data directory (0600); otherwise both must be set, and
        FailClosedError names what `command` needs."""
        keyring_file = self.salt_keyring_file
        # The first of several during a rotation (`signing_key_files` lists them all).
        signing_file = self.signing_key_files()[0] if self.signing_key_file else None
        if self.mode is Mode.DEV:
            from kvguard.audit.signing import SigningKey  # noqa: PLC0415 (audit imports settings)

            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.load_keyring()  # creates the dev keyring file if missing
            keyring_file = keyring_file or self.data_dir / "salt.keys"
            signing_file = signing_file or self.data_dir / "ledger-signing.key"
            if not signing_file.exists():
                SigningKey.generate(origin).save(signing_file)
        if keyring_file is None or signing_file is None:
            raise FailClosedError(
                f"{command} needs KVGUARD_SALT_KEYRING_FILE and KVGUARD_SIGNING_KEY_FILE "
                "(or KVGUARD_MODE=dev to generate development keys under KVGUARD_DATA_DIR)"
            )
        return Path(keyring_file), Path(signing_file)

    def load_keyring(self) -> Keyring:
        """The salt keyring, from file, then env, then (dev mode only) a generated dev keyring."""
        if self.salt_keyring_file is not None:
            return Keyring.load(self.salt_keyring_file)
        if self.salt_key is not None:
            return _keyring_from_env(self.salt_key)
        if self.mode is Mode.DEV:
            return _dev_keyring(self.data_dir / "salt.keys")
        raise FailClosedError(
            "no salt key configured: set KVGUARD_SALT_KEYRING_FILE (a 0600 keyring file made by "
            "`kvguard keys salt-keyring`) or KVGUARD_SALT_KEY, or run with KVGUARD_MODE=dev"
        )


def load_settings() -> Settings:
    """The settings from the environment; ConfigError naming the first variable that does not
    parse (`KVGUARD_MODE: Input should be 'dev' or 'prod'`), never its value (a secret may sit in
    the wrong variable), instead of pydantic's multi-line report."""
    try:
        return Settings()
    except ValidationError as exc:
        error = exc.errors(include_input=False, include_url=False)[0]
        where = error.get("loc") or ("?",)
        name = "KVGUARD_" + str(where[0]).upper()
        raise ConfigError(f"{name}: {error.get('msg', 'invalid value')}") from None


def _keyring_from_env(value: SecretStr) -> Keyring:
    raw_text = value.get_secret_value()
    register_secret(raw_text)
    try:
        raw = base64.b64decode(raw_text, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("KVGUARD_SALT_KEY is not valid base64") from None
    return Keyring({"env": raw}, active="env")


def _dev_keyring(path: Path) -> Keyring:
    if path.exists():
        return Keyring.load(path)
    _log.warning("generated a development salt keyring; not for production", path=str(path))
    ring = Keyring.generate("dev1")
    ring.save(path)
    return ring
