"""Found by an independent re-test of the auditor's path (each test failed on the code before its
fix): a checkpoint row with the log's true root under an unsigned or badly signed note, which the
app role may INSERT, must not stop exports; a certificate's fixed sanitization statements and its
evidence tree size are checked."""

from __future__ import annotations

import base64
import copy
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kvguard.audit import note
from kvguard.audit.certificate import set_path, verify_certificate
from kvguard.audit.checkpoint import Checkpoint, format_checkpoint
from kvguard.audit.ledger import Ledger
from kvguard.audit.signing import SigningKey
from kvguard.errors import VerificationError
from tests.dbs import PG_URL, migrate_and_grant

from .conftest import ORIGIN, make_event


def _true_root_row_note(ledger: Ledger, size: int, *, our_id_bad_sig: bool) -> tuple[bytes, str]:
    """The log's *true* root at `size` (anyone who saw a checkpoint or can SELECT the stored
    hashes knows it) under a note the log never signed: no signature at all, or a line naming
    the log's key name and key ID with a garbage signature."""
    root = ledger.root(size)
    text = format_checkpoint(Checkpoint(ORIGIN, size, root))
    if not our_id_bad_sig:
        return root, text
    key = ledger.signing_keys[0]
    line = "\u2014 " + key.name + " " + base64.b64encode(key.key_id + bytes(64)).decode() + "\n"
    return root, note.join_note(text, [line])


@pytest.mark.parametrize("our_id_bad_sig", [False, True], ids=["unsigned", "bad-signature"])
def test_one_insert_of_a_true_root_checkpoint_row_does_not_stop_every_later_export(
    our_id_bad_sig: bool, sqlite_url: str, open_ledger: Any, tmp_path: Path
) -> None:
    """docs/audit.md: "no single INSERT or UPDATE by the app role can stop later appends or reads";
    a checkpoint row the app role inserts with a note the log did not sign is skipped by the
    exporter. With the true root in the row (public: every checkpoint carries it), the exporter
    decides "a signed checkpoint was damaged" and refuses every later export, for ever (the row
    cannot be deleted). Checkpoints go on; exports do not."""
    ledger = open_ledger(sqlite_url)
    ledger.append_many([make_event(i) for i in range(5)])
    ledger.checkpoint()
    ledger.append_many([make_event(i) for i in range(5, 9)])
    root, forged = _true_root_row_note(ledger, 9, our_id_bad_sig=our_id_bad_sig)
    with ledger.store.engine.begin() as conn:  # one INSERT the triggers accept
        conn.exec_driver_sql(
            "INSERT INTO ledger_checkpoints (size, root, note, prev_size) VALUES (9, ?, ?, 5)",
            (root, forged),
        )
    ledger.append_many([make_event(i) for i in range(9, 12)])
    ledger.checkpoint()  # goes on
    summary = ledger.export(
        tmp_path / "bundle"
    )  # VerificationError: "a signed checkpoint was damaged"
    assert summary.tree_size == 12


@contextmanager
def _rt_app_role() -> Iterator[str]:
    """A fresh database `rt_*` with owner and app roles `rt_*` (docs/operations.md), dropped after."""
    suffix = uuid.uuid4().hex[:8]
    name, owner, app = f"rt_audit_{suffix}", f"rt_owner_{suffix}", f"rt_app_{suffix}"
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {owner} LOGIN")
            conn.exec_driver_sql(f"CREATE ROLE {app} LOGIN")
            conn.exec_driver_sql(f'CREATE DATABASE "{name}" OWNER {owner}')
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.skip(f"PostgreSQL not reachable: {exc.__class__.__name__}")
    base = sa.engine.make_url(PG_URL).set(database=name)
    try:
        su = sa.create_engine(base, isolation_level="AUTOCOMMIT")
        with su.connect() as conn:
            conn.exec_driver_sql(f"ALTER SCHEMA public OWNER TO {owner}")
        su.dispose()
        migrate_and_grant(base.set(username=owner).render_as_string(hide_password=False), app)
        yield base.set(username=app).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {app}")
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {owner}")
        admin.dispose()


@pytest.mark.postgres
def test_postgres_app_role_true_root_checkpoint_row_does_not_stop_exports(
    key: SigningKey, tmp_path: Path
) -> None:
    """The same INSERT as the least-privilege app role of `kvguard db grants`."""
    with _rt_app_role() as app_url:
        ledger = Ledger.open(app_url, origin=ORIGIN, signing_key=key)
        try:
            ledger.append_many([make_event(i) for i in range(5)])
            ledger.checkpoint()
            ledger.append_many([make_event(i) for i in range(5, 9)])
            root, forged = _true_root_row_note(ledger, 9, our_id_bad_sig=False)
            engine = sa.create_engine(app_url)
            try:
                with engine.begin() as conn:
                    conn.exec_driver_sql(
                        "INSERT INTO ledger_checkpoints (size, root, note, prev_size) "
                        "VALUES (9, %s, %s, 5)",
                        (root, forged),
                    )
            finally:
                engine.dispose()
            ledger.append_many([make_event(i) for i in range(9, 12)])
            ledger.checkpoint()
            assert ledger.export(tmp_path / "bundle").tree_size == 12
        finally:
            ledger.close()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("sanitization.method_type", "Destroy"),  # NIST SP 800-88: a far stronger claim than Clear
        ("sanitization.method_used", "Degauss"),
        ("evidence.tree_size", 999),  # the checkpoint the proofs are against has size 5
    ],
)
def test_certificate_claims_the_api_docs_call_backed_are_checked(
    path: str, value: Any, sqlite_url: str, open_ledger: Any, key: SigningKey
) -> None:
    """docs/api.md: `sanitization` (method_type "Clear", method_used "Overwrite with zeros") is
    backed by the zeroize entries and `evidence.tree_size` by the evidence itself; the verifier
    accepts a certificate that passes every job/selector check while lying about these."""
    from tests.audit.test_auditor_edges import _certificate, _purge_log  # noqa: PLC0415

    ledger = _purge_log(open_ledger, sqlite_url)
    doc = _certificate(ledger, [0, 1, 2, 3, 4])
    verify_certificate(copy.deepcopy(doc), [key.verifier_key()])  # control: valid
    set_path(doc, path, value)
    with pytest.raises(VerificationError):
        verify_certificate(doc, [key.verifier_key()])
