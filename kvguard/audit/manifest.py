"""The export manifest: what a bundle holds, signed by the log, so that nothing can be left out.

A bundle's proofs show that each entry it holds is in the log; they cannot show that nothing was
removed from the bundle afterwards. Deleting lines of `entries.jsonl`, or `consistency.jsonl`, or
`proofs/`, left a bundle that still verified (issue 12, item 5). The exporter therefore signs, with
the log's own key, a manifest naming the checkpoint, the selection (the whole log or a filter), the
number of entries and the SHA-256 of every file; the offline verifier requires it.

The manifest is a C2SP signed note (`kvguard.audit.note`) whose text is:

    kvguard.audit/export-manifest/v1
    origin <the log origin>
    tree <size> <base64 root>
    selection complete                  (or: selection filtered <canonical JSON of the filter>)
    entries <number of entries.jsonl lines>
    file <name> <sha256 hex>            (one per file, sorted by name; not `checkpoint`)
    proofs <number of proofs/*.tlog-proof files>

Its first line can never be a checkpoint's origin followed by a decimal size (the second line here
starts with `origin `), so a manifest signature can never be taken for a checkpoint signature, nor
the reverse. Standard library only: the offline verifier imports this module.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvguard.audit.checkpoint import b64decode_strict
from kvguard.errors import VerificationError

MANIFEST = "manifest"
HEADER = "kvguard.audit/export-manifest/v1"
COMPLETE = "complete"
_NAME = re.compile(r"^[a-z][a-z0-9.]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DECIMAL = re.compile(r"^(0|[1-9][0-9]{0,19})$")


@dataclass(frozen=True)
class Manifest:
    origin: str
    size: int
    root: bytes
    selection: str  # COMPLETE, or the canonical JSON of the export's filter
    entries: int
    files: Mapping[str, str] = field(default_factory=dict)  # name -> SHA-256 hex
    proofs: int = 0

    @property
    def complete(self) -> bool:
        return self.selection == COMPLETE


def selection_text(filters: Mapping[str, Any] | None) -> str:
    """COMPLETE for an unfiltered export (`filters` None), else `filtered <canonical JSON>` of the
    filters that are set (an empty list is set: it selects nothing)."""
    if filters is None:
        return COMPLETE
    used = {k: v for k, v in filters.items() if v is not None}
    body = json.dumps(used, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=True)
    return f"filtered {body}"


def format_manifest(m: Manifest) -> str:
    """The manifest text (what the log's key signs)."""
    if "\n" in m.origin or "\n" in m.selection or not m.origin:
        raise ValueError("manifest origin and selection are single non-empty lines")
    lines = [
        HEADER,
        f"origin {m.origin}",
        f"tree {m.size} {base64.b64encode(m.root).decode()}",
        f"selection {m.selection}",
        f"entries {m.entries}",
    ]
    for name in sorted(m.files):
        if not _NAME.match(name) or not _HEX64.match(m.files[name]):
            raise ValueError(f"invalid manifest file line for {name!r}")
        lines.append(f"file {name} {m.files[name]}")
    lines.append(f"proofs {m.proofs}")
    return "".join(line + "\n" for line in lines)


def parse_manifest(text: str) -> Manifest:
    """Parse a manifest text strictly (it must re-format to the same text)."""
    lines = text.split("\n")
    if len(lines) < 7 or lines[-1] != "" or lines[0] != HEADER:
        raise VerificationError("manifest: not a kvguard export manifest (v1)")
    try:
        origin = _field(lines[1], "origin")
        size_text, root_text = _field(lines[2], "tree").split(" ")
        selection = _field(lines[3], "selection")
        entries = _number(_field(lines[4], "entries"))
        files: dict[str, str] = {}
        for line in lines[5:-2]:
            name, digest = _field(line, "file").split(" ")
            files[name] = digest
        proofs = _number(_field(lines[-2], "proofs"))
        m = Manifest(
            origin,
            _number(size_text),
            b64decode_strict(root_text, "manifest root"),
            selection,
            entries,
            files,
            proofs,
        )
        if format_manifest(m) != text:
            raise ValueError("not in canonical form")
    except ValueError as exc:
        raise VerificationError(f"manifest: malformed ({exc})") from None
    return m


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _field(line: str, key: str) -> str:
    prefix = key + " "
    if not line.startswith(prefix) or len(line) == len(prefix):
        raise ValueError(f"expected a {key!r} line")
    return line[len(prefix) :]


def _number(text: str) -> int:
    if not _DECIMAL.match(text):
        raise ValueError(f"{text!r} is not a decimal number")
    return int(text)
