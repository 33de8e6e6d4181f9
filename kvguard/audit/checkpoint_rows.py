"""Stored checkpoint rows that this process's keys do not verify: which ones the signer skips, the
one line it logs for them, and which ones the exporter still keeps (a retired key's).

Anyone with INSERT on `ledger_checkpoints` can add a row, signed by any key or by none, so no such
row is ever trusted and none may stop a checkpoint or an export (docs/audit.md, Trust model). The
signer's search (`Ledger.trusted_checkpoint`) runs under the head row lock, so it tells rows apart
by their signature lines alone (`stranger_signed`), never by recomputing a stored root per row: 10,000
planted rows once took 2.9 s on SQLite and 7.4 s on PostgreSQL per checkpoint, all of it under the
lock. The exporter still checks a retired key's row against the stored tree (`retired_key_row`),
since it keeps that row's consistency proof.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from kvguard.audit import note
from kvguard.audit.checkpoint import parse_checkpoint
from kvguard.audit.store import CheckpointRow, LedgerStore
from kvguard.errors import VerificationError


def stranger_signed(row_note: str, ours: Sequence[note.Verifier]) -> bool:
    """True if `row_note` splits into a text and signatures, none of them by a key in `ours`
    (by name and key id): a retired key's row, or a forged one; its signatures are not checked.
    False for an unsigned or malformed note, and for one that one of our keys signed."""
    try:  # a note that splits has at least one signature line
        return not note.signed_by_any(row_note, ours)
    except (VerificationError, ValueError):
        return False


def retired_key_row(
    store: LedgerStore,
    conn: sa.Connection,
    row: CheckpointRow,
    *,
    origin: str,
    ours: Sequence[note.Verifier],
) -> bool:
    """True for a stored checkpoint this log may have signed with a key it no longer holds (a
    finished rotation, docs/operations.md): `stranger_signed`, a checkpoint of `origin` for the
    row's own size and root, and the stored tree reproduces that root. Its signature cannot be
    checked here (the retired key is the auditors' trust root, `kvguard verify --key`), so True
    grants no trust: an export keeps the row's consistency line only because the auditor checks
    that proof against the new, signed root."""
    if not stranger_signed(row.note, ours):
        return False  # unsigned, or one of our keys signed it and it did not verify: tampered
    try:
        cp = parse_checkpoint(note.split_note(row.note)[0])
    except (VerificationError, ValueError):
        return False
    if (cp.origin, cp.size, cp.root) != (origin, row.size, row.root):
        return False
    return row.size <= store.size(conn) and store.root(row.size, conn) == row.root


class SkippedRows:
    """The rows one search for the trusted checkpoint skipped, logged as one line (not one per
    row: a table of planted rows made as many warnings per checkpoint)."""

    def __init__(self) -> None:
        self.count = 0
        self.stranger_signed = 0
        self.highest: int | None = None
        self.lowest: int | None = None
        self.first_problem: str | None = None

    def add(self, size: int, problem: str, *, stranger: bool) -> None:
        """Skip the row of `size` (`problem`: why it does not verify; `stranger`: signed by no
        key this process holds). Rows come newest first."""
        self.count += 1
        self.stranger_signed += stranger
        self.highest = size if self.highest is None else self.highest
        self.lowest = size
        self.first_problem = self.first_problem or problem

    def log(self, logger: Any) -> None:
        """One line, if any row was skipped: a warning, or an info line when every skipped row is
        signed by a key this process does not hold (what a finished key rotation leaves)."""
        if not self.count:
            return
        level = logger.info if self.stranger_signed == self.count else logger.warning
        level(
            "ledger checkpoint rows skipped: not signed by this log's keys (a retired key's, "
            "forged, or damaged); never trusted",
            skipped=self.count,
            signed_by_other_keys=self.stranger_signed,
            highest_size=self.highest,
            lowest_size=self.lowest,
            reason=self.first_problem,
        )
