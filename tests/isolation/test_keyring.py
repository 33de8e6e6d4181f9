from __future__ import annotations

import os

import pytest

from kvguard.errors import ConfigError, SecretFileError, UnknownKeyError
from kvguard.isolation import Keyring


def test_roundtrip_via_0600_file(tmp_path) -> None:
    ring = Keyring.generate("k1").rotated("k2")
    path = ring.save(tmp_path / "salt.keys")
    assert os.stat(path).st_mode & 0o777 == 0o600
    loaded = Keyring.load(path)
    assert loaded.kids == ["k1", "k2"] and loaded.active == "k2" and loaded.tag_kid == "k1"
    assert loaded.secret("k2") == ring.secret("k2")


def test_group_readable_file_refused(tmp_path) -> None:
    path = Keyring.generate().save(tmp_path / "salt.keys")
    os.chmod(path, 0o640)
    with pytest.raises(SecretFileError, match="chmod 600"):
        Keyring.load(path)


def test_malformed_file_error_does_not_quote_content(tmp_path) -> None:
    path = tmp_path / "bad.keys"
    path.write_text('{"active": "k1", "keys": {"k1": "not base64 TOPSECRET!!"}}')
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError) as info:
        Keyring.load(path)
    assert "TOPSECRET" not in str(info.value)


def test_invariants() -> None:
    with pytest.raises(ConfigError, match="empty"):
        Keyring({}, active="k1")
    with pytest.raises(ConfigError, match="at least 32"):
        Keyring({"k1": b"short"}, active="k1")
    with pytest.raises(ConfigError, match="not in the keyring"):
        Keyring({"k1": bytes(32)}, active="k2")
    with pytest.raises(ConfigError, match="key id"):
        Keyring({"bad id!": bytes(32)}, active="bad id!")
    ring = Keyring({"k1": bytes(32)}, active="k1")
    with pytest.raises(ConfigError, match="already exists"):
        ring.rotated("k1")
    with pytest.raises(UnknownKeyError):
        ring.secret("nope")


def test_repr_and_wipe_hide_key_material() -> None:
    ring = Keyring({"k1": b"\xaa" * 32}, active="k1")
    assert "aa" not in repr(ring).lower().replace("kids", "")
    ring.wipe()
    with pytest.raises(UnknownKeyError):
        ring.secret("k1")


@pytest.mark.parametrize(
    "template",
    [
        '{{"active":"k1","keys":{{"k1":"{a}","k1":"{b}"}}}}',  # a key id twice: one key lost
        '{{"active":"k1","active":"k2","keys":{{"k1":"{a}","k2":"{b}"}}}}',  # the active id moved
    ],
)
def test_a_keyring_naming_anything_twice_is_refused(template: str) -> None:
    """A hand-merged keyring that names a key id, or `active`, twice loaded with the last of them
    (a key silently gone, the next rotation writing the file back without it; found by a review).
    Refused, naming neither the name nor the key."""
    import base64  # noqa: PLC0415

    a, b = (base64.b64encode(bytes([i]) * 32).decode() for i in (1, 2))
    with pytest.raises(ConfigError, match="repeats a name") as caught:
        Keyring.from_json(template.format(a=a, b=b).encode())
    assert a not in str(caught.value) and b not in str(caught.value)
    assert "k1" not in str(caught.value) and "active" not in str(caught.value)
