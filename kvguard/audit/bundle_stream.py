"""Export bundles as a stream: the `kvguard audit export` bundle (`kvguard.audit.bundle`) as a tar
archive, optionally gzip-compressed, produced while it is sent.

The archive holds one directory, `kvguard-audit-<tree size>/`, with `checkpoint`,
`consistency.jsonl`, `entries.jsonl`, `payloads.jsonl` and last the signed `manifest` (which needs
every other file's digest), byte for byte what `Ledger.export(..., renderings=False)` writes for the
same checkpoint; unpacked, it passes `kvguard verify DIR --key VKEY --origin ORIGIN`. The SIEM renderings are left out: their size is unknown before they
are rendered, and the verifier regenerates nothing that is absent.

Memory stays flat however large the export: entries are read in index order through a
server-side cursor and written chunk by chunk (`kvguard.audit.proof_runs`). A tar header must state
its member's size before the member, so `entries.jsonl` is measured first, by a pass over the
matching rows: a line's size follows from its index, leaf length and proof length
(`bundle.entry_line_size`) and whether the leaf is an event or a foreign entry (`bundle.leaf_event`:
an event is embedded, a foreign leaf is carried as `"event":null`), which this pass decides once per
leaf, checking a filtered export's index columns against each event on the way. The log is
append-only and the export stops at the signed tree size, so both passes see the same rows; if they
did not, the stream fails (`VerificationError`) rather than end in a well-formed but wrong archive.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kvguard.audit import bundle, merkle, note, payloads
from kvguard.audit import schema as t
from kvguard.audit.checkpoint import Checkpoint, parse_checkpoint
from kvguard.audit.export import consistency_lines, payload_lines
from kvguard.audit.leaf import format_micros
from kvguard.audit.manifest import MANIFEST, Manifest, format_manifest, selection_text
from kvguard.audit.proof_runs import CHUNK_BITS, ProofRuns
from kvguard.audit.query import select_indices
from kvguard.audit.selection import Selection
from kvguard.errors import VerificationError
from kvguard.logging import get_logger

if TYPE_CHECKING:
    from kvguard.audit.ledger import Ledger

_log = get_logger("kvguard.audit.export")
_BLOCK = 512  # tar block size
_FLUSH = 1 << 20  # bytes handed to the transport at once: few enough hand-offs per second
_GZIP_LEVEL = 1  # base64 hashes barely compress; level 1 keeps up with the generator (measured)
_YIELD_PER = 4096
_LINE = b'{"event":%s,"inclusion_proof":[%s],"index":%d,"leaf":"%s"}\n'  # = bundle.entry_line


@dataclass(frozen=True)
class ExportQuery:
    """Which entries an export holds. Empty `kinds` means every kind; empty `scope_tags` none."""

    scope_tags: Sequence[str] | None = None
    kinds: Sequence[str] | None = None
    since: datetime | None = None
    until: datetime | None = None

    @property
    def complete(self) -> bool:
        return self.scope_tags is None and not self.kinds and self.since is None and not self.until

    def filters(self, size: int) -> dict[str, Any]:
        return {
            "scope_tags": self.scope_tags,
            "kinds": list(self.kinds) if self.kinds else None,
            "since": self.since,
            "until": self.until,
            "below": size,
        }


class BundleStream:
    """One export: signs a checkpoint when made; iterating yields the archive's bytes."""

    def __init__(
        self, ledger: Ledger, query: ExportQuery, *, gzip: bool = False, mtime: int = 0
    ) -> None:
        self._ledger, self._query, self._gzip, self._mtime = ledger, query, gzip, mtime
        self._foreign: set[int] = set()  # foreign leaves a complete export carries (`_measure`)
        self._skipped: set[int] = set()  # foreign leaves a filtered export leaves out
        self._selection = Selection.of(
            scope_tags=query.scope_tags, kinds=query.kinds, since=query.since, until=query.until
        )
        self.checkpoint = ledger.checkpoint()
        cp = parse_checkpoint(note.split_note(self.checkpoint)[0])
        self.tree_size, self._root = cp.size, cp.root
        self.name = f"kvguard-audit-{cp.size}"
        self.filename = self.name + (".tar.gz" if gzip else ".tar")
        self.media_type = "application/gzip" if gzip else "application/x-tar"

    def __iter__(self) -> Iterator[bytes]:
        pending: list[bytes] = []
        held = 0
        pack = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, 31) if self._gzip else None
        for piece in self._archive():
            pending.append(piece)
            held += len(piece)
            if held >= _FLUSH:
                data = b"".join(pending)
                pending, held = [], 0
                out = pack.compress(data) if pack else data
                if out:
                    yield out
        data = b"".join(pending)
        yield (pack.compress(data) + pack.flush()) if pack else data

    def _archive(self) -> Iterator[bytes]:
        engine = self._ledger.store.engine
        digests: dict[str, str] = {}
        committed: list[tuple[int, bytes]] = []
        cp = Checkpoint(self._ledger.origin, self.tree_size, self._root)
        with engine.connect() as conn, engine.connect() as aux:
            yield _header(self.name + "/", 0, self._mtime, directory=True)
            yield from self._member(bundle.CHECKPOINT, self.checkpoint.encode("utf-8"))
            lines = consistency_lines(self._ledger, conn, self.tree_size, self._root)
            yield from self._member(bundle.CONSISTENCY, "".join(lines).encode("utf-8"), digests)
            size = self._measure(conn)
            yield _header(f"{self.name}/{bundle.ENTRIES}", size, self._mtime)
            written, count, digest = 0, 0, hashlib.sha256()
            foreign = self._foreign
            for piece, rows in self._entries(conn, aux):
                written += len(piece)
                digest.update(piece)
                count += len(rows)
                committed += [
                    (i, c)
                    for i, leaf in rows
                    if not (foreign and i in foreign) and (c := payloads.commitment_in_leaf(leaf))
                ]
                yield piece
            if written != size:
                raise VerificationError(f"{bundle.ENTRIES} changed while it was exported")
            yield _padding(size)
            digests[bundle.ENTRIES] = digest.hexdigest()
            text = "".join(payload_lines(self._ledger, conn, committed, cp)).encode("utf-8")
            yield from self._member(payloads.PAYLOADS, text, digests)
        filters = None if self._query.complete else self._query.filters(self.tree_size)
        if filters is not None:
            filters.pop("below")
        manifest = Manifest(
            self._ledger.origin,
            self.tree_size,
            self._root,
            selection_text(filters),
            count,
            digests,
        )
        signed = self._ledger.sign_note(format_manifest(manifest)).encode("utf-8")
        yield from self._member(MANIFEST, signed)
        yield b"\0" * (2 * _BLOCK)  # end of archive

    def _member(
        self, name: str, data: bytes, digests: dict[str, str] | None = None
    ) -> Iterator[bytes]:
        if digests is not None:
            digests[name] = hashlib.sha256(data).hexdigest()
        yield _header(f"{self.name}/{name}", len(data), self._mtime)
        yield data
        yield _padding(len(data))

    def _measure(self, conn: sa.Connection) -> int:
        """Bytes of `entries.jsonl`. Decides, once per leaf, which are foreign (`self._foreign`,
        used by the writing pass) and which filtered rows are left out (foreign ones: no filter
        selects what is not an event). A filtered export reads every entry below the checkpoint
        and checks each event's columns against its leaf before selecting on them: a column moved
        *out* of the filter would otherwise hide its entry from a query on it (found by a
        review: the entry was left out, the bundle signed and verified)."""
        q = self._query
        n, line_size, path_length = (
            self.tree_size,
            bundle.entry_line_size,
            merkle.inclusion_path_length,
        )
        total = 0
        for index, raw, *columns in conn.execute(self._statement()):
            leaf = bytes(raw)
            event = bundle.is_event(leaf)
            if not event:
                _log.warning(
                    "ledger entry is not a kvguard event (written outside kvguard)", index=index
                )
                if not q.complete:
                    self._skipped.add(int(index))
                    continue
                self._foreign.add(int(index))
            elif columns and not self._selected(int(index), leaf, columns):
                continue
            total += line_size(index, len(leaf), path_length(index, n), foreign=not event)
        return total

    def _statement(self) -> sa.Select[Any]:
        """Every entry below the checkpoint; with its index columns for a filtered export."""
        stmt = select_indices(below=self.tree_size)
        if not self._query.complete:
            e = t.entries.c
            stmt = stmt.add_columns(e.kind, e.scope_tag, e.ts_us)
        return stmt.execution_options(yield_per=_YIELD_PER)

    def _selected(self, index: int, leaf: bytes, columns: Sequence[Any]) -> bool:
        """Whether a filtered export holds this event, once its columns are the leaf's."""
        kind, tag, ts_us = columns
        if not (
            _holds(leaf, b',"kind":', json.dumps(kind), b',"payload_c')
            and _holds(leaf, b',"scope_tag":', json.dumps(tag), b',"ts":')
            and _holds(leaf, b',"ts":', f'"{format_micros(ts_us)}"', b',"v":')
        ):
            raise VerificationError(f"entry {index}: index columns do not match the leaf")
        return self._selection.holds(tag, kind, ts_us)

    def _entries(
        self, conn: sa.Connection, aux: sa.Connection
    ) -> Iterator[tuple[bytes, list[tuple[int, bytes]]]]:
        """`entries.jsonl`, one chunk of consecutive indices at a time, with the chunk's rows."""
        proofs = ProofRuns(
            self._ledger.store, aux, self.tree_size, self._root, complete=self._query.complete
        )
        chunk: list[tuple[int, bytes]] = []
        foreign = self._foreign
        for index, leaf in self._rows(conn):
            if chunk and index >> CHUNK_BITS != chunk[0][0] >> CHUNK_BITS:
                yield _lines(chunk, proofs.chunk(chunk), foreign), chunk
                chunk = []
            chunk.append((index, leaf))
        if chunk:
            yield _lines(chunk, proofs.chunk(chunk), foreign), chunk

    def _rows(self, conn: sa.Connection) -> Iterator[tuple[int, bytes]]:
        """(index, leaf) of the matching entries, less the foreign ones a filtered export leaves
        out (`_measure` decided which); a filtered export's columns are checked again, so a row
        changed between the two passes stops the export instead of changing what it holds."""
        skipped, complete = self._skipped, self._query.complete
        for index, raw, *columns in conn.execute(self._statement()):
            if skipped and index in skipped:
                continue
            leaf = bytes(raw)
            if complete or self._selected(int(index), leaf, columns):
                yield int(index), leaf


def _holds(leaf: bytes, key: bytes, value: str, following: bytes) -> bool:
    """Whether an event leaf's (`bundle.is_event`: canonical, keys sorted) top-level field `key`
    is `value` (JSON text). `kind`, `scope_tag` and `ts` come after `details` (sorted keys) and a
    `,"` can occur only between fields (a quote inside a string is escaped), so the last `key` is
    the top-level one. Slicing costs a fraction of `json.loads` per row."""
    at = leaf.rfind(key)
    return at >= 0 and leaf.startswith(key + value.encode("utf-8") + following, at)


def _lines(rows: list[tuple[int, bytes]], proofs: list[bytes], foreign: set[int]) -> bytes:
    b2a = binascii.b2a_base64
    return b"".join(
        [
            _LINE
            % (
                bundle.FOREIGN_EVENT if foreign and i in foreign else leaf,
                p,
                i,
                b2a(leaf, newline=False),
            )
            for (i, leaf), p in zip(rows, proofs, strict=True)
        ]
    )


def _header(name: str, size: int, mtime: int, *, directory: bool = False) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = size, mtime
    info.mode = 0o755 if directory else 0o644
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)
