from __future__ import annotations

import base64
import os

import pytest

from kvguard.errors import ConfigError, FailClosedError, SecretFileError
from kvguard.isolation import Keyring
from kvguard.settings import Mode, Settings


def test_G7_missing_secret_fails_closed_outside_dev(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVGUARD_SALT_KEY", raising=False)
    with pytest.raises(FailClosedError, match="no salt key configured"):
        Settings(data_dir=tmp_path).load_keyring()


def test_dev_mode_generates_a_0600_keyring_once(tmp_path) -> None:
    settings = Settings(mode=Mode.DEV, data_dir=tmp_path)
    first = settings.load_keyring()
    assert os.stat(tmp_path / "salt.keys").st_mode & 0o777 == 0o600
    assert settings.load_keyring().secret(first.active) == first.secret(first.active)


def test_env_prefix_and_key_from_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVGUARD_SALT_KEY", base64.b64encode(bytes(range(32))).decode())
    monkeypatch.setenv("KVGUARD_DATA_DIR", str(tmp_path))
    settings = Settings()
    assert settings.data_dir == tmp_path
    assert settings.load_keyring().active == "env"
    assert "sqlite:///" in settings.database_url()


def test_bad_env_key_error_has_no_value(monkeypatch) -> None:
    monkeypatch.setenv("KVGUARD_SALT_KEY", "%%%NOTB64SECRET%%%")
    with pytest.raises(ConfigError) as info:
        Settings().load_keyring()
    assert "NOTB64SECRET" not in str(info.value)


def test_world_readable_keyring_file_refused(tmp_path) -> None:
    path = Keyring.generate().save(tmp_path / "k")
    os.chmod(path, 0o604)
    with pytest.raises(SecretFileError, match="0604"):
        Settings(salt_keyring_file=path).load_keyring()


def test_secret_fields_hidden_in_repr(monkeypatch) -> None:
    monkeypatch.setenv("KVGUARD_SALT_KEY", "c2VjcmV0c2VjcmV0c2VjcmV0")
    assert "c2VjcmV0" not in repr(Settings())
