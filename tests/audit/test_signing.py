"""C2SP signed notes, Ed25519 checkpoint keys, key files and rotation."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kvguard.audit import note
from kvguard.audit.checkpoint import (
    Checkpoint,
    format_checkpoint,
    format_tlog_proof,
    parse_checkpoint,
    parse_tlog_proof,
)
from kvguard.audit.signing import SigningKey
from kvguard.errors import SecretFileError, VerificationError

from .conftest import conformance_dir


def _example() -> dict[str, object]:
    return json.loads((conformance_dir("signed-note") / "example.json").read_text())  # type: ignore[no-any-return]


def test_signed_note_conformance_example_verifies() -> None:
    case = _example()
    verifier = note.parse_verifier_key(str(case["verifier_key"]))
    expect = case["expect"]
    assert isinstance(expect, dict)
    assert verifier.key_id.hex() == expect["key_id_hex"]
    assert note.key_id(verifier.name, verifier.public_key).hex() == expect["key_id_hex"]
    assert note.verifier_key_string(verifier.name, verifier.public_key) == case["verifier_key"]
    text, signers = note.open_note(str(case["note"]), [verifier])
    assert text == expect["text"] and signers == [verifier]


def test_signed_note_example_rejects_any_text_change() -> None:
    case = _example()
    verifier = note.parse_verifier_key(str(case["verifier_key"]))
    tampered = str(case["note"]).replace("example message", "exemplary message")
    with pytest.raises(VerificationError, match="does not verify"):
        note.open_note(tampered, [verifier])


def test_unknown_keys_are_ignored_but_one_trusted_signature_is_required() -> None:
    a, b = SigningKey.generate("log.a"), SigningKey.generate("log.b")
    text = "hello\n"
    signed = note.join_note(text, [a.signature_line(text)])
    with pytest.raises(VerificationError, match="not signed by any trusted key"):
        note.open_note(signed, [b.verifier()])
    both = note.join_note(text, [b.signature_line(text), a.signature_line(text)])
    assert note.open_note(both, [a.verifier()])[1] == [a.verifier()]


def test_a_repeated_line_of_a_known_key_is_ignored_as_go_does() -> None:
    """golang.org/x/mod/sumdb/note `Open` verifies a known key's first line and skips later ones."""
    a = SigningKey.generate("log.a")
    text = "hello\n"
    twice = note.join_note(text, [a.signature_line(text), a.signature_line(text)])
    assert note.open_note(twice, [a.verifier()])[1] == [a.verifier()]
    other = a.signature_line("other text\n")  # a well-formed line that does not verify here
    assert note.open_note(note.join_note(text, [a.signature_line(text), other]), [a.verifier()])
    with pytest.raises(VerificationError, match="does not verify"):  # the first line decides
        note.open_note(note.join_note(text, [other, a.signature_line(text)]), [a.verifier()])


def test_note_text_may_hold_blank_lines_and_ends_at_the_last_one() -> None:
    """c2sp.org/signed-note, "Format": the text MAY contain empty lines; it is separated from the
    signatures by the last empty line."""
    a = SigningKey.generate("log.a")
    for text in ("first\n\nsecond\n", "a\n\n\nb\n", "ends blank\n\n"):
        signed = note.join_note(text, [a.signature_line(text)])
        assert note.open_note(signed, [a.verifier()])[0] == text
    with pytest.raises(VerificationError, match="control characters"):
        note.open_note("x\n\n\u2014 log.a A\tB\n", [a.verifier()])
    with pytest.raises(VerificationError, match="signature block"):
        note.split_note("\n\n\u2014 log.a AAAAAAAA\n")


def test_key_id_changes_with_name_so_a_key_cannot_be_relabelled() -> None:
    key = SigningKey.generate("log.a")
    vkey = key.verifier_key()
    _name, hex_id, blob = vkey.split("+", 2)
    with pytest.raises(VerificationError, match="key ID"):
        note.parse_verifier_key(f"log.b+{hex_id}+{blob}")
    assert note.parse_verifier_key(vkey) == key.verifier()


def test_key_file_is_0600_round_trips_and_refuses_loose_permissions(tmp_path: Path) -> None:
    key = SigningKey.generate("log.kvguard.test")
    path = key.save(tmp_path / "signing.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().startswith("PRIVATE+KEY+log.kvguard.test+")
    loaded = SigningKey.load(path)
    assert loaded.verifier_key() == key.verifier_key()
    assert "PRIVATE" not in repr(loaded)
    with pytest.raises(SecretFileError):
        key.save(path)  # never overwrites silently
    os.chmod(path, 0o644)
    with pytest.raises(SecretFileError, match="chmod 600"):
        SigningKey.load(path)


def test_checkpoint_body_format_is_exact() -> None:
    cp = Checkpoint("example.com/log", 42, b"\x01" * 32)
    text = format_checkpoint(cp)
    assert text == "example.com/log\n42\nAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\n"
    assert parse_checkpoint(text) == cp
    for bad in [
        text[:-1],
        text.replace("42", "042"),
        text.replace("42", "-1"),
        text.replace("AQE=", "AQF="),
        "example.com/log\n42\n",
    ]:
        with pytest.raises(VerificationError):
            parse_checkpoint(bad)


def test_tlog_proof_file_round_trips_strictly() -> None:
    key = SigningKey.generate("log.a")
    body = format_checkpoint(Checkpoint("log.a/x", 8, b"\x02" * 32))
    signed = note.join_note(body, [key.signature_line(body)])
    text = format_tlog_proof(5, [b"\x03" * 32, b"\x04" * 32], signed, extra=b"ctx")
    assert text.startswith("c2sp.org/tlog-proof@v1\nextra Y3R4\nindex 5\n")
    parsed = parse_tlog_proof(text)
    assert (parsed.leaf_index, parsed.proof, parsed.signed_checkpoint) == (
        5,
        [b"\x03" * 32, b"\x04" * 32],
        signed,
    )
    with pytest.raises(VerificationError):
        parse_tlog_proof(text.replace("index 5", "index 05"))
