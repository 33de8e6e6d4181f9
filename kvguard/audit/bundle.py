"""The export bundle format (version 1): file names, the entry line, and the SIEM renderings.

A bundle is a directory:

- `checkpoint`: the signed C2SP checkpoint every proof in the bundle is against;
- `entries.jsonl`: one line per entry, canonical JSON with sorted keys:
  `{"event": <the leaf's JSON>, "inclusion_proof": [base64...], "index": N, "leaf": base64}`;
  `event` is the leaf itself, embedded for reading, so it can never disagree with `leaf`. A leaf
  that is not a kvguard event (`leaf_event` is None: a row written into the log by something other
  than kvguard, e.g. a role holding INSERT) is a *foreign* entry: its line carries `"event":null`
  and the leaf only as base64, so that any leaf the log holds can be exported and proven;
- `entries.csv`, `entries.ocsf.jsonl` (optional): renderings for SIEM import, derived from the leaves
  only, so the verifier regenerates them and compares byte for byte;
- `consistency.jsonl` (optional): `{"old_checkpoint": note, "proof": [base64...]}` per earlier
  checkpoint, proving the log only grew since;
- `proofs/<index>.tlog-proof` (optional): one c2sp.org/tlog-proof@v1 file per entry.

Standard library only: the offline verifier imports this module.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import math
import re
from collections.abc import Sequence
from datetime import UTC, date, datetime
from typing import Any

CHECKPOINT = "checkpoint"
ENTRIES = "entries.jsonl"
CSV = "entries.csv"
OCSF = "entries.ocsf.jsonl"
CONSISTENCY = "consistency.jsonl"
PROOFS = "proofs"
PROOF_SUFFIX = ".tlog-proof"
KNOWN_FILES = frozenset({CHECKPOINT, ENTRIES, CSV, OCSF, CONSISTENCY})

CSV_COLUMNS = (
    "index",
    "ts",
    "kind",
    "scope_tag",
    "request_id",
    "block_ids",
    "details",
    "payload_commitment",
)
_OCSF_VERSION = "1.3.0"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


# What a kvguard event's leaf is, byte for byte (`kvguard.audit.leaf`, version 1: canonical JSON,
# keys sorted, no whitespace, flat `details`), as one pattern that every reader (the exporters,
# both verifier paths, the renderings, the listings, the byte-level slicing of commitments and
# index columns) reads alike, in any Python. It admits a few leaves kvguard would not write (details
# out of key order, a detail name the model refuses, `-0`), none that any reader reads
# differently: kinds are lower-case words, tags and request ids printable ASCII (the
# model's rule), string escapes only those `json` writes (no `\uD800`: no lone surrogate), integers
# of at most 640 digits (the lowest `int_max_str_digits` Python allows; the model refuses longer
# ones), floats as `repr` spells them. Strings are written unrolled (runs of plain characters,
# then one escape).
_STR = rb'"[^"\\\x00-\x1f]*(?:\\(?:["\\bfnrt]|u00[01][0-9a-f])[^"\\\x00-\x1f]*)*"'
# printable ASCII, `"` and `\` escaped (unrolled as `_STR`)
_ASCII = rb'"[\x21\x23-\x5b\x5d-\x7e]*(?:\\["\\][\x21\x23-\x5b\x5d-\x7e]*)*"'
_INT = rb"-?(?:0|[1-9][0-9]{0,639})"
# a number as `repr` writes a float or int: a float with an exponent has one digit before its
# point (`1e+16`, `5e-324`, `1.7976931348623157e+308`); one without has at most 16 digits before
# the point and at most 20 after it (`repr` writes down to 1e-4 without an exponent, so up to three
# zeros precede 17 significant digits, e.g. 0.00012345678901234567); an integer has no point. So
# no literal overflows but one with an exponent of 308 or more (`_BIG_EXPONENT`): `18e+307` is
# infinity and was read as an event while any number of digits could precede an exponent.
_NUM = (
    rb"-?(?:[1-9](?:\.[0-9]{1,16})?e[+-][0-9]{2,3}|(?:0|[1-9][0-9]{0,15})\.[0-9]{1,20}"
    rb"|0|[1-9][0-9]{0,639})(?![0-9])"
)
_SCALAR = rb"(?:" + _STR + rb"|" + _NUM + rb"|true|false|null)"
_PAIR = _STR + rb":" + _SCALAR
_EVENT_LEAF = re.compile(
    rb'\{"block_ids":\[(?:' + _INT + rb"(?:," + _INT + rb")*)?\]"
    rb',"details":\{(?:' + _PAIR + rb"(?:," + _PAIR + rb")*)?\}"
    rb',"kind":"[a-z][a-z_.]*","payload_commitment":(?:null|"[0-9a-f]{64}")'
    rb',"request_id":(?:null|' + _ASCII + rb")"
    rb',"scope_tag":(?:null|' + _ASCII + rb")"
    rb',"ts":"([0-9]{4}-[0-9]{2}-[0-9]{2}T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]\.[0-9]{6})Z"'
    rb',"v":1\}'
)
# An exponent from 308 up: a float there may overflow to infinity, which `repr` never writes.
_BIG_EXPONENT = re.compile(rb"[0-9]e\+(?:30[89]|3[1-9][0-9]|[4-9][0-9][0-9])")
# Runs of events, each followed by a newline, for `first_non_event`: `_EVENT_LEAF` without its
# group (the date is checked once per distinct date there). A leaf matching `_EVENT_LEAF` holds no
# raw newline, so with as many newlines as leaves each run is one leaf.
_EVENT_RUN = re.compile(
    rb"(?:" + _EVENT_LEAF.pattern.replace(rb'"ts":"(', rb'"ts":"(?:') + rb"\n)*"
)
_DATE_AT = slice(-35, -25)  # YYYY-MM-DD in `..."ts":"YYYY-MM-DDTHH:MM:SS.ffffffZ","v":1}`
FOREIGN_EVENT = b"null"  # the `event` of a foreign entry's line


def is_event(leaf: bytes) -> bool:
    """Whether a leaf is a kvguard event; if not, it is *foreign* (written into the log by
    something other than kvguard, e.g. a database role holding INSERT): exported as
    `"event":null` with its leaf in base64, never rendered, never read for a commitment. An event
    matches `_EVENT_LEAF`, is UTF-8, names a real time (no month 13; no hour 24, which the pattern
    refuses and Python 3.14's `fromisoformat` would take) and holds finite numbers."""
    found = _EVENT_LEAF.fullmatch(leaf)
    if found is None:
        return False
    try:
        leaf.decode("utf-8")
        datetime.fromisoformat(found.group(1).decode("ascii"))
    except ValueError:  # UnicodeDecodeError is a ValueError
        return False
    if b"e+" in leaf and _BIG_EXPONENT.search(leaf) is not None:  # rare: refuse an infinity
        details = json.loads(leaf)["details"]
        return all(not isinstance(v, float) or math.isfinite(v) for v in details.values())
    return True


def first_non_event(leaves: Sequence[bytes]) -> int | None:
    """The position of the first leaf that is not an event (`is_event`), None if every one is.

    For the offline `--full` check, which reads every leaf: one match of `_EVENT_RUN` over the
    leaves joined by newlines, UTF-8 decoded at once and each distinct date checked once (for the
    engine's entries 1.8 us per leaf against 3.0 for `is_event`, measured on a slow VM; an
    independent review measured 15% less on its leaves, and more than `is_event` for leaves of
    hundreds of float details). Anything the run does not settle (a leaf that is not an event, an
    exponent of 308 or more) is decided by `is_event`, leaf by leaf."""
    if not leaves:
        return None
    block = b"\n".join(leaves) + b"\n"
    if (
        block.count(b"\n") == len(leaves)
        and _EVENT_RUN.fullmatch(block) is not None
        and (b"e+" not in block or _BIG_EXPONENT.search(block) is None)
    ):
        try:
            block.decode("utf-8")
            for day in {leaf[_DATE_AT] for leaf in leaves}:
                date.fromisoformat(day.decode("ascii"))
        except ValueError:
            pass
        else:
            return None
    return next((j for j, leaf in enumerate(leaves) if not is_event(leaf)), None)


def leaf_event(leaf: bytes) -> dict[str, Any] | None:
    """The event a leaf holds, parsed, or None for a foreign leaf (`is_event`)."""
    if not is_event(leaf):
        return None
    try:
        event: dict[str, Any] = json.loads(leaf)
    except (ValueError, RecursionError):  # not reached: the pattern admits only JSON
        return None
    return event


def entry_line(index: int, leaf: bytes, proof_b64: Sequence[str], *, foreign: bool = False) -> str:
    """The exact `entries.jsonl` line of one entry (canonical JSON; an event's `leaf` is canonical
    JSON, a foreign one is carried as base64 only: `foreign` is `leaf_event(leaf) is None`)."""
    return entry_line_joined(index, leaf, ",".join(f'"{p}"' for p in proof_b64), foreign=foreign)


def entry_line_joined(index: int, leaf: bytes, quoted_proof: str, *, foreign: bool = False) -> str:
    """`entry_line` with the proof already rendered as `"b64","b64",...` (the fast path)."""
    event = "null" if foreign else leaf.decode("utf-8")
    return (
        f'{{"event":{event},"inclusion_proof":[{quoted_proof}],'
        f'"index":{index},"leaf":"{b64(leaf)}"}}\n'
    )


_LINE_FIXED = len(entry_line_joined(0, b"", "")) - 1  # the line less its index digits
_PROOF_HASH_TEXT = 46  # '"' + 44 base64 characters of a 32-byte hash + '"'


def entry_line_size(index: int, leaf_size: int, proof_hashes: int, *, foreign: bool = False) -> int:
    """Bytes of `entry_line(index, leaf, proof, foreign=foreign)` (UTF-8) for a leaf of
    `leaf_size` bytes and a proof of `proof_hashes` 32-byte hashes, without rendering it: a
    streamed export announces the size of `entries.jsonl` before writing it."""
    proof = proof_hashes * (_PROOF_HASH_TEXT + 1) - 1 if proof_hashes else 0
    event = len(FOREIGN_EVENT) if foreign else leaf_size
    return _LINE_FIXED + len(str(index)) + event + 4 * ((leaf_size + 2) // 3) + proof


def consistency_line(old_checkpoint: str, proof: Sequence[bytes]) -> str:
    obj = {"old_checkpoint": old_checkpoint, "proof": [b64(h) for h in proof]}
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"


def csv_header() -> str:
    return _csv_text(CSV_COLUMNS)


def csv_line(index: int, leaf: dict[str, Any], *, legacy: bool = False) -> str:
    """The `entries.csv` line of one event, every cell through `spreadsheet_cell` (`index` and
    `block_ids` as numeric columns; `details` is a JSON object, so it starts with `{`).

    `legacy`: every cell as is, the rendering kvguard wrote before the cells were neutralised
    (commit 344b40e). Only the verifier asks for it, so that archived bundles still verify
    (`CsvStyle`); no exporter writes it."""
    details = json.dumps(leaf["details"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    cells = (
        str(index),
        leaf["ts"],
        leaf["kind"],
        leaf["scope_tag"] or "",
        leaf["request_id"] or "",
        " ".join(str(b) for b in leaf["block_ids"]),
        details,
        leaf["payload_commitment"] or "",
    )
    if legacy:
        return _csv_text(cells)
    return _csv_text(
        [spreadsheet_cell(c, numeric=n) for c, n in zip(cells, _NUMERIC_COLUMNS, strict=True)]
    )


_NUMERIC_COLUMNS = tuple(name in {"index", "block_ids"} for name in CSV_COLUMNS)


class CsvStyle:
    """Which rendering an `entries.csv` holds, one for the whole file: the current one, or the
    legacy one (`csv_line(..., legacy=True)`) of bundles exported before the cells were
    neutralised, which must still verify (archived evidence). A file mixing both is no file any
    kvguard wrote. A line whose cells need no prefix reads the same in both and decides nothing,
    so `legacy` stays None for a file that no style change touches."""

    def __init__(self) -> None:
        self.legacy: bool | None = None

    def problem(self, line: str | None, index: int, leaf: dict[str, Any]) -> str | None:
        """Why `line` is not the rendering of entry `index` in this file's style (None if it
        is); the first line that reads differently in the two styles decides the style."""
        current = csv_line(index, leaf)
        # A neutralised cell starts with `'`: without one the two renderings are equal.
        old = csv_line(index, leaf, legacy=True) if "'" in current else current
        if line == current == old:
            return None
        if line not in {current, old}:
            return "differs from the proven leaf"
        if self.legacy is None:
            self.legacy = line == old
        if self.legacy != (line == old):
            return "mixes the legacy rendering (cells as is) with the neutralised one"
        return None


# What makes a spreadsheet read a CSV cell as a formula (OWASP, "CSV Injection"), plus the quote
# that neutralises one, so that the prefix below can always be undone.
_FORMULA_STARTS = frozenset("=+-@\t\r'")
_INTEGER = re.compile(r"-?[0-9]+")


def spreadsheet_cell(value: str, *, numeric: bool = False) -> str:
    """`value` as a CSV cell that no spreadsheet runs as a formula (CSV injection): a cell that
    starts with `=`, `+`, `-`, `@`, a tab or a carriage return is prefixed with `'`, which Excel
    and LibreOffice show as text. A tag or request id is whatever its writer chose (printable
    ASCII), so `-2+3` or `=HYPERLINK(...)` is an attack, never a number.

    A cell that starts with `'` is prefixed too, so a reader gets the value back exactly by
    dropping one leading `'` (kvguard reads no CSV back: the verifier regenerates the lines).
    In a numeric column (`numeric`) a cell that is one integer (`-5`) stays as it is: a
    spreadsheet reads it as that number, and it can hold no formula; a list of ids starting
    with `-` is prefixed like text. The rule is part of the bundle format: the offline verifier
    regenerates every line with this function and compares byte for byte (a bundle exported
    before the rule, every line without it, is accepted as legacy: `CsvStyle`)."""
    if value[:1] not in _FORMULA_STARTS or (numeric and _INTEGER.fullmatch(value)):
        return value
    return "'" + value


def _csv_text(row: Sequence[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(row)
    return buf.getvalue()


def ocsf_line(index: int, leaf: dict[str, Any], origin: str) -> str:
    """An OCSF-style (schema 1.3, Base Event class) record of one entry, one JSON line."""
    ts = datetime.strptime(leaf["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    record = {
        "activity_id": 99,
        "activity_name": leaf["kind"],
        "category_name": "Uncategorized",
        "category_uid": 0,
        "class_name": "Base Event",
        "class_uid": 0,
        "message": f"kvguard {leaf['kind']}",
        "metadata": {
            "log_name": origin,
            "original_time": leaf["ts"],
            "product": {"name": "kvguard", "vendor_name": "kvguard"},
            "uid": str(index),
            "version": _OCSF_VERSION,
        },
        "severity": "Informational",
        "severity_id": 1,
        "time": int(ts.timestamp() * 1000),
        "type_uid": 99,
        "unmapped": {
            "block_ids": leaf["block_ids"],
            "details": leaf["details"],
            "payload_commitment": leaf["payload_commitment"],
            "request_id": leaf["request_id"],
            "scope_tag": leaf["scope_tag"],
        },
    }
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"


def proof_name(index: int) -> str:
    return f"{index}{PROOF_SUFFIX}"
