"""The offline verifier: checks an export bundle with nothing but the log's verifier key(s).

Depends only on `cryptography` and the standard library (a test enforces it), so an auditor can run
it without trusting, or even installing, the operator's database stack.

Steps (docs/audit.md walks through them):
1. the listing holds only known files, and `checkpoint`, `manifest` and `entries.jsonl`;
2. `checkpoint` is a C2SP signed note by a trusted key and a well-formed tlog-checkpoint naming the
   expected origin (`--origin`, the pinned checkpoint's, or the name of every given key);
3. `manifest` is signed by a trusted key and names the same checkpoint (`kvguard.audit.manifest`);
4. every `entries.jsonl` line is exactly the canonical line for its index, leaf and proof, indices
   strictly increase, and each RFC 9162 inclusion proof leads to the signed root; a complete bundle
   (per the manifest) holds exactly entries 0..size-1; with `full` the root is also recomputed
   from all leaves;
5. `entries.csv` and `entries.ocsf.jsonl`, when present, equal their regeneration from the leaves
   (`entries.csv` in one style throughout: the current one, or the legacy one, reported);
6. `payloads.jsonl` accounts for every exported payload commitment: present (the log's signed
   statement) or erased, with the erasure entry's proof (`kvguard.audit.payloads`);
7. each `consistency.jsonl` line carries an older checkpoint signed by a trusted key and an RFC 9162
   consistency proof from it to the bundle's checkpoint; with a trusted (pinned) checkpoint, one of
   them must start at it;
8. `proofs/` holds exactly one c2sp.org/tlog-proof@v1 file per entry, each against the same
   checkpoint and leading to the signed root;
9. the entry count and every file's SHA-256 equal the manifest's, no listed file is missing and no
   unlisted one present: a deleted, duplicated or reordered line, a deleted `consistency.jsonl` or
   `proofs/` fails; a complete bundle must carry its consistency data.
The first failure raises `VerificationError` naming the file, line and entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, AnyStr, Final

from kvguard.audit import bundle, merkle, note, offline_full, payloads
from kvguard.audit.checkpoint import (
    Checkpoint,
    b64decode_strict,
    parse_checkpoint,
    parse_tlog_proof,
)
from kvguard.audit.manifest import MANIFEST, Manifest, file_digest, parse_manifest
from kvguard.audit.selection import Selection, ts_micros
from kvguard.errors import VerificationError

Progress = Callable[[int, int], None]
_PROGRESS_EVERY = 4096
_FOREIGN_LINE = b'{"event":' + bundle.FOREIGN_EVENT + b',"inclusion_proof":['  # bundle.entry_line


@dataclass(frozen=True)
class BundleReport:
    origin: str
    tree_size: int
    entries: int
    full: bool
    consistency_proofs: int
    tlog_proofs: int
    complete: bool = False
    payloads: int = 0
    erased_payloads: int = 0
    pinned_size: int | None = None
    # Entries whose leaf is not a kvguard event (`bundle.leaf_event`): proven part of the log, but
    # written into it by something other than kvguard (e.g. a database role holding INSERT).
    foreign: tuple[int, ...] = ()
    # The signed manifest's selection: `complete`, or `filtered` and the export's filters as JSON.
    selection: str = "complete"
    # The signed note verified, as read (a caller that saves it or checks its cosignatures uses
    # this text, not the file read again: the file may have changed since).
    checkpoint_note: str = ""
    # `entries.csv` is in the legacy rendering (`bundle.CsvStyle`): exported before its cells
    # were neutralised, so a cell may run as a formula in a spreadsheet.
    csv_legacy: bool = False


class OriginNotPinnedError(VerificationError):
    """No expected origin: neither `--origin`, a trusted checkpoint, nor a key named after it."""


def verify_bundle(
    directory: str | Path,
    verifier_keys: Sequence[str],
    *,
    full: bool = False,
    progress: Progress | None = None,
    origin: str | None = None,
    parallel: bool = True,
    trusted_checkpoint: str | None = None,
) -> BundleReport:
    """Verify the bundle in `directory`; raise VerificationError at the first problem.

    The checkpoint must name the expected origin (a key may sign for several logs): `origin`, else
    the origin of `trusted_checkpoint`, else the name of every verifier key (the C2SP custom of
    naming a log's key after its origin); otherwise OriginNotPinnedError. With
    `trusted_checkpoint` (a signed checkpoint the auditor kept), the bundle must prove that its
    log extends it. With `parallel`, `full` checks large files in two processes
    (`kvguard.audit.offline_full`)."""
    d = Path(directory)
    verifiers = [note.parse_verifier_key(k) for k in verifier_keys]
    if not verifiers:
        raise VerificationError("no verifier key given")
    pinned = None
    if trusted_checkpoint is not None:
        try:
            pinned = parse_checkpoint(note.open_note(trusted_checkpoint, verifiers)[0])
        except VerificationError as exc:
            raise VerificationError(f"trusted checkpoint: {exc}") from None
    _check_listing(d)
    try:
        return _verify_files(
            d,
            verifiers,
            full=full,
            progress=progress,
            parallel=parallel,
            origin=origin,
            pinned=pinned,
        )
    except UnicodeDecodeError:
        raise VerificationError("a bundle file is not valid UTF-8") from None
    except RecursionError:  # a last guard: each JSON reader below names its own file and line
        raise VerificationError("a bundle file holds JSON nested too deeply to be one") from None
    except OSError as exc:  # e.g. a proof file replaced by a folder
        raise VerificationError(f"cannot read {Path(exc.filename or '?').name}") from None
    except MemoryError:  # a last guard: files and lines are read within bounds below
        raise VerificationError("a bundle file is too large to verify in memory") from None


def expected_origin(
    found: str, origin: str | None, pinned: Checkpoint | None, verifiers: Sequence[note.Verifier]
) -> None:
    """Raise unless the checkpoint's origin `found` is the one the auditor expects."""
    if origin is None and pinned is not None:
        origin = pinned.origin
    if origin is None:
        if all(v.name == found for v in verifiers):
            return  # pinned by the key: every trusted key is named after this log
        raise OriginNotPinnedError(
            f"the checkpoint names origin {found!r}, which neither --origin, a trusted checkpoint "
            "nor the key names pin: pass --origin with the log you expect"
        )
    if found != origin:
        raise VerificationError(
            f"checkpoint: origin is {found!r}, expected {origin!r} (a checkpoint of another log, "
            "or the wrong --origin)"
        )


def _verify_files(
    d: Path,
    verifiers: list[note.Verifier],
    *,
    full: bool,
    progress: Progress | None,
    parallel: bool,
    origin: str | None,
    pinned: Checkpoint | None,
) -> BundleReport:
    signed = _read_text(d / bundle.CHECKPOINT)
    try:
        cp = parse_checkpoint(note.open_note(signed, verifiers)[0])
    except VerificationError as exc:
        raise VerificationError(f"checkpoint: {exc}") from None
    expected_origin(cp.origin, origin, pinned, verifiers)
    m = _verify_manifest(d, cp, verifiers)
    leaf_hashes = _verify_entries(
        d,
        cp,
        full,
        progress=progress,
        parallel=parallel,
        complete=m.complete,
        selection=m.selection,
    )
    if len(leaf_hashes) != m.entries:
        raise VerificationError(
            f"{bundle.ENTRIES}: {len(leaf_hashes)} entries, the manifest says {m.entries} "
            "(lines deleted or added)"
        )
    csv_legacy = _verify_renderings(d, cp)
    present, erased, foreign = _verify_payloads(d, cp)
    olds = _verify_consistency(d, cp, verifiers)
    if pinned is not None:
        _check_pinned(pinned, cp, olds)
    tlog = _verify_tlog_proofs(d, cp, signed, leaf_hashes)
    _check_digests(d, m, tlog)
    return BundleReport(
        cp.origin,
        cp.size,
        len(leaf_hashes),
        full,
        len(olds),
        tlog,
        m.complete,
        present,
        erased,
        pinned.size if pinned is not None else None,
        tuple(foreign),
        m.selection,
        signed,
        csv_legacy,
    )


def _verify_manifest(d: Path, cp: Checkpoint, verifiers: Sequence[note.Verifier]) -> Manifest:
    try:
        m = parse_manifest(note.open_note(_read_text(d / MANIFEST), verifiers)[0])
    except VerificationError as exc:
        raise VerificationError(f"manifest: {exc}") from None
    if (m.origin, m.size, m.root) != (cp.origin, cp.size, cp.root):
        raise VerificationError("manifest: names another checkpoint than the bundle's")
    if m.complete and bundle.CONSISTENCY not in m.files:
        raise VerificationError("manifest: a complete bundle must carry consistency.jsonl")
    return m


def _check_digests(d: Path, m: Manifest, tlog: int) -> None:
    """Every file but `checkpoint` and `manifest` is listed with its SHA-256, and nothing listed
    is missing (a deleted `consistency.jsonl` fails here); the proofs count matches."""
    present = {
        p.name for p in d.iterdir() if p.is_file() and p.name not in {bundle.CHECKPOINT, MANIFEST}
    }
    for name in sorted(present | set(m.files)):
        if name not in m.files:
            raise VerificationError(f"{name}: not listed in the manifest")
        if name not in present:
            raise VerificationError(f"{name}: listed in the manifest but missing from the bundle")
        if file_digest(d / name) != m.files[name]:
            raise VerificationError(f"{name}: SHA-256 differs from the manifest's")
    if tlog != m.proofs:
        raise VerificationError(
            f"{bundle.PROOFS}/: {tlog} tlog-proof files, the manifest says {m.proofs}"
        )


def _check_pinned(pinned: Checkpoint, cp: Checkpoint, olds: list[Checkpoint]) -> None:
    """The bundle's log must extend the checkpoint the auditor kept (issue 12, item 1)."""
    where = f"trusted checkpoint (size {pinned.size})"
    if pinned.origin != cp.origin:
        raise VerificationError(
            f"{where}: is of log {pinned.origin!r}, the bundle of {cp.origin!r}"
        )
    if pinned.size > cp.size:
        raise VerificationError(
            f"{where}: the bundle's checkpoint (size {cp.size}) is older than it; ask for a "
            "newer export"
        )
    if pinned.size == cp.size:
        if pinned.root != cp.root:
            raise VerificationError(f"{where}: same size, different root: the log forked")
        return
    if pinned.size == 0:
        return
    same_size = [o for o in olds if o.size == pinned.size]
    if any(o.root == pinned.root for o in same_size):
        return
    if same_size:
        raise VerificationError(
            f"{where}: the log signed another root at this size: the log forked or was rewritten"
        )
    raise VerificationError(
        f"{where}: the bundle carries no consistency proof from it, so it does not show that "
        "the log only grew since (the checkpoint is unknown to the log, or its row was removed)"
    )


def _check_listing(d: Path) -> None:
    if not d.is_dir():
        raise VerificationError(f"{d} is not a directory")
    known = {*bundle.KNOWN_FILES, MANIFEST, payloads.PAYLOADS}
    for child in d.iterdir():
        if child.is_symlink():  # a link could point anywhere (a device, a pipe, another file)
            raise VerificationError(f"unexpected link in bundle: {child.name}")
        ok = child.name in known and child.is_file()
        ok = ok or (child.name == bundle.PROOFS and child.is_dir())
        if not ok:
            raise VerificationError(f"unexpected file in bundle: {child.name}")
    proofs = d / bundle.PROOFS
    for child in proofs.iterdir() if proofs.is_dir() else ():
        if child.is_symlink() or not child.is_file():
            raise VerificationError(f"unexpected file in bundle: {bundle.PROOFS}/{child.name}")
    for required in (bundle.CHECKPOINT, MANIFEST, bundle.ENTRIES):
        if not (d / required).is_file():
            hint = " (written by kvguard 0.2 and later; re-export)" if required == MANIFEST else ""
            raise VerificationError(f"bundle has no {required}{hint}")


# Bounds on what is read at once: a signed note (checkpoint, manifest, a tlog proof) or one line of
# a bundle file holds at most a few hundred kB (a leaf's 4,096 block ids, a proof's 64 hashes);
# a file made larger is refused, not read into memory (a sparse file, a line with no end).
_MAX_NOTE: Final = 16 << 20
_MAX_LINE: Final = offline_full.MAX_LINE


def _read_text(path: Path) -> str:
    with open(path, "rb") as f:
        raw = f.read(_MAX_NOTE + 1)
    if len(raw) > _MAX_NOTE:
        raise VerificationError(
            f"{path.name}: larger than any file of its kind ({_MAX_NOTE} bytes)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise VerificationError(f"{path.name} is not valid UTF-8") from None


def _lines(path: Path, stack: ExitStack) -> Iterator[str]:
    """The file's lines, each at most `_MAX_LINE` characters (VerificationError past that)."""
    return _bounded(stack.enter_context(open(path, encoding="utf-8", newline="")), path.name)


def _bounded(f: IO[AnyStr], name: str) -> Iterator[AnyStr]:
    while True:
        try:
            line = f.readline(_MAX_LINE + 1)
        except UnicodeDecodeError:
            raise VerificationError(f"{name} is not valid UTF-8") from None
        if not line:
            return
        if len(line) > _MAX_LINE:
            raise VerificationError(f"{name}: a line longer than any line of its kind")
        yield line


def _verify_entries(
    d: Path,
    cp: Checkpoint,
    full: bool,
    *,
    progress: Progress | None,
    parallel: bool = False,
    complete: bool = False,
    selection: str | None = None,
) -> dict[int, bytes]:
    """Check entries.jsonl (the renderings follow: `_verify_renderings`). Leaf hashes by index."""
    selected = _in_selection(selection)
    if full:
        hashes = _verify_full(d, cp, progress, parallel)
        if selected is not None:  # a filtered bundle is held to its selection on both paths
            _check_full_selection(d, selected)
        return hashes
    return _verify_proven_lines(d, cp, progress, complete, selected)


def _check_full_selection(d: Path, selected: Callable[[dict[str, Any]], bool]) -> None:
    """`--full` of a filtered bundle: every line's event (each line already proven canonical, its
    embedded event the leaf's) is one the signed selection names, and none is foreign (found by a
    review: `--full` accepted a bundle labelled one tenant's that held every tenant's entries)."""
    with ExitStack() as stack:
        for number, line in enumerate(_lines(d / bundle.ENTRIES, stack), start=1):
            obj = json.loads(line)
            _check_selected(obj["event"], selected, _where(number, obj["index"]))


def _check_selected(
    event: dict[str, Any] | None, selected: Callable[[dict[str, Any]], bool], where: str
) -> None:
    if event is None:  # filtered exports leave foreign leaves out: no filter selects them
        raise VerificationError(f"{where}: a foreign entry in a filtered bundle")
    if not selected(event):
        raise VerificationError(f"{where}: an entry outside the manifest's selection")


# The filters `kvguard audit export` (`scope_tag`) and the API's export (`scope_tags`) sign.
_SELECTION_KEYS: Final = frozenset({"scope_tag", "scope_tags", "kinds", "since", "until"})


def _in_selection(selection: str | None) -> Callable[[dict[str, Any]], bool] | None:
    """For a filtered bundle, whether an event is one its signed selection names (the filters
    the exports write, `kvguard.audit.selection`): an exporter cannot label one tenant's entries
    as another's. None: nothing to check."""
    if selection is None or not selection.startswith("filtered "):
        return None
    try:
        filters = json.loads(selection.removeprefix("filtered "))
        if set(filters) - _SELECTION_KEYS:
            raise ValueError("unknown filter")
        chosen = Selection.of(
            scope_tag=_text(filters.get("scope_tag")),
            scope_tags=_texts(filters.get("scope_tags")),
            kinds=_texts(filters.get("kinds")),
            since=_aware(filters.get("since")),
            until=_aware(filters.get("until")),
        )
    except (ValueError, TypeError, AttributeError):
        raise VerificationError("manifest: a selection this verifier cannot read") from None

    def selected(event: dict[str, Any]) -> bool:
        try:
            ts = _aware(str(event.get("ts", "")).replace("Z", "+00:00"))
            return ts is not None and chosen.holds(
                event.get("scope_tag"), event.get("kind"), ts_micros(ts)
            )
        except (ValueError, TypeError):
            return False

    return selected


def _text(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("not a string")
    return value


def _texts(value: object) -> list[str] | None:
    if value is not None and not (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    ):
        raise TypeError("not a list of strings")
    return value


def _verify_renderings(d: Path, cp: Checkpoint) -> bool:
    """The CSV and OCSF renderings against the proven entries: after the entries and their
    count, so that lines deleted from entries.jsonl are blamed on it, not on a rendering.
    True if `entries.csv` is in the legacy style (`bundle.CsvStyle`)."""
    style = bundle.CsvStyle()
    with ExitStack() as stack:
        renderings = _open_renderings(d, stack)
        if renderings:
            _check_all_renderings(d, stack, renderings, cp.origin, style)
    return bool(style.legacy)


def _where(number: int, index: int | None = None) -> str:
    return f"{bundle.ENTRIES} line {number}" + (f" (entry {index})" if index is not None else "")


def _full_where(index: int) -> str:
    return _where(index + 1, index)


def _halves(
    progress: Progress | None, size: int
) -> tuple[offline_full.Progress | None, offline_full.Progress | None]:
    """Map the byte progress of the two `--full` passes onto entries: each pass is half the work."""
    if progress is None:
        return None, None
    report = progress

    def first(done: int, total: int) -> None:
        report(size * done // (2 * total), size)

    def second(done: int, total: int) -> None:
        report(size // 2 + size * done // (2 * total), size)

    return first, second


def _verify_full(
    d: Path, cp: Checkpoint, progress: Progress | None, parallel: bool
) -> dict[int, bytes]:
    """`--full`: rebuild the tree from every leaf, compare its root with the signed one, then hold
    every line to its canonical form with the recomputed proof (`kvguard.audit.offline_full`)."""
    path = d / bundle.ENTRIES
    first_half, second_half = _halves(progress, cp.size)
    parts = offline_full.split(path, parallel)
    tree = offline_full.full_levels(path, parts, _full_where, first_half, cp.size)
    leaf_hashes = tree.levels[0]
    if len(leaf_hashes) != cp.size:
        raise VerificationError(
            f"--full needs the complete log: {len(leaf_hashes)} entries, checkpoint has {cp.size}"
        )
    if merkle.levels_root(tree.levels) != cp.root:
        _verify_entries(d, cp, False, progress=None)  # finds and names the first entry that fails
        raise VerificationError("the entries do not reproduce the signed root")
    offline_full.check_lines(path, tree, _full_where, second_half)
    if progress is not None:
        progress(cp.size, cp.size)
    return dict(enumerate(leaf_hashes))


def _aware(text: object) -> datetime | None:
    """An ISO 8601 time (UTC when it names no zone); None for None."""
    if text is None:
        return None
    ts = datetime.fromisoformat(str(text))
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def _verify_proven_lines(
    d: Path,
    cp: Checkpoint,
    progress: Progress | None,
    complete: bool = False,
    selected: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[int, bytes]:
    """Without `--full`: each line carries its own proof, checked against the signed root; a
    complete bundle must hold entry `i` on line `i + 1`, all `size` of them."""
    hashes: dict[int, bytes] = {}
    previous = -1
    with ExitStack() as stack:
        for number, line in enumerate(_lines(d / bundle.ENTRIES, stack), start=1):
            index, leaf, proof, foreign = _check_line_proof(line, _where(number), cp, previous)
            if complete and index != number - 1:
                raise VerificationError(
                    f"{_where(number, index)}: a complete bundle holds entry {number - 1} here "
                    "(a line was deleted or moved)"
                )
            if line != bundle.entry_line(index, leaf, proof, foreign=foreign):
                raise VerificationError(
                    f"{_where(number, index)}: line differs from the canonical entry"
                )
            if foreign == bundle.is_event(leaf):
                raise VerificationError(
                    f"{_where(number, index)}: "
                    + (
                        "a kvguard event is carried as a foreign entry"
                        if foreign
                        else "a leaf that is not a kvguard event is carried as one"
                    )
                )
            if selected is not None:  # foreign lines too: filtered exports never carry one
                event = None if foreign else bundle.leaf_event(leaf)
                _check_selected(event, selected, _where(number, index))
            hashes[index] = merkle.leaf_hash(leaf)
            previous = index
            if progress is not None and number % _PROGRESS_EVERY == 0:
                progress(number, 0)
    if complete and len(hashes) != cp.size:
        raise VerificationError(
            f"{bundle.ENTRIES}: a complete bundle holds all {cp.size} entries, this one "
            f"{len(hashes)} (lines deleted at the end)"
        )
    if progress is not None:
        progress(len(hashes), len(hashes))
    return hashes


def _verify_payloads(d: Path, cp: Checkpoint) -> tuple[int, int, list[int]]:
    """Every exported commitment stated present or its erasure proven (`kvguard.audit.payloads`).
    Also returns the indices of the foreign entries (`"event":null`, which commit to nothing)."""
    committed: dict[int, bytes] = {}
    foreign: list[int] = []
    erased: set[int] = set()  # indices the bundle's payload.erase entries name
    marker = b',"payload_commitment":"'
    erase = b'"kind":"' + payloads.ERASE_KIND.encode() + b'"'
    with open(d / bundle.ENTRIES, "rb") as f:
        for line in _bounded(f, bundle.ENTRIES):
            if line.startswith(_FOREIGN_LINE):  # canonical (checked above): a foreign entry
                foreign.append(json.loads(line)["index"])
                continue
            if erase in line:  # a payload.erase entry, perhaps: its leaf says
                named = payloads.erased_index(
                    b64decode_strict(json.loads(line)["leaf"], bundle.ENTRIES)
                )
                if named is not None:
                    erased.add(named)
            if marker in line:  # canonical lines (checked above): the leaf holds a commitment
                obj = json.loads(line)
                leaf = b64decode_strict(obj["leaf"], bundle.ENTRIES)
                found = payloads.commitment_in_leaf(leaf)
                if found is not None:
                    committed[obj["index"]] = found
    path = d / payloads.PAYLOADS
    if not path.is_file():
        if committed:
            raise VerificationError(f"bundle has no {payloads.PAYLOADS} but entries commit to one")
        return 0, 0, foreign
    with ExitStack() as stack:
        present, gone = payloads.check_payload_lines(_lines(path, stack), committed, cp, erased)
    return present, gone, foreign


def _check_all_renderings(
    d: Path,
    stack: ExitStack,
    renderings: dict[str, Iterator[str]],
    origin: str,
    style: bundle.CsvStyle,
) -> None:
    """Third pass, only where renderings exist: regenerate each from the (now proven) leaves."""
    for number, line in enumerate(_lines(d / bundle.ENTRIES, stack), start=1):
        obj = json.loads(line)
        if obj["event"] is None:
            continue  # a foreign entry (proven above not to be an event): not rendered
        index, leaf = obj["index"], b64decode_strict(obj["leaf"], _where(number))
        where = _where(number, index)
        _check_renderings(renderings, index, leaf, where, origin=origin, style=style)
    for name, lines in renderings.items():
        if next(lines, None) is not None:
            raise VerificationError(f"{name}: more lines than entries")


def _check_line_proof(
    line: str, where: str, cp: Checkpoint, previous: int
) -> tuple[int, bytes, list[str], bool]:
    """(index, leaf, proof, foreign) of a line whose inclusion proof leads to the signed root;
    `foreign`: the line carries `"event":null` (`bundle.leaf_event`)."""
    try:
        obj = json.loads(line)
        index, leaf_b64, proof = obj["index"], obj["leaf"], obj["inclusion_proof"]
        foreign = obj["event"] is None
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
        raise VerificationError(f"{where}: not an entry line") from None
    if not isinstance(index, int) or isinstance(index, bool) or index <= previous:
        raise VerificationError(f"{where}: index is not an integer above the previous one")
    if not isinstance(proof, list) or not all(isinstance(p, str) for p in proof):
        raise VerificationError(f"{where}: inclusion_proof is not a list of strings")
    leaf = b64decode_strict(str(leaf_b64), f"{where}: leaf")
    raw = [b64decode_strict(p, f"{where}: proof hash") for p in proof]
    try:
        merkle.verify_inclusion(index, cp.size, merkle.leaf_hash(leaf), raw, cp.root)
    except VerificationError as exc:
        raise VerificationError(f"{where} (entry {index}): {exc}") from None
    return index, leaf, proof, foreign


def _open_renderings(d: Path, stack: ExitStack) -> dict[str, Iterator[str]]:
    out = {}
    for name in (bundle.CSV, bundle.OCSF):
        if (d / name).is_file():
            out[name] = _lines(d / name, stack)
    if bundle.CSV in out and next(out[bundle.CSV], None) != bundle.csv_header():
        raise VerificationError(f"{bundle.CSV}: header differs")
    return out


def _check_renderings(
    renderings: dict[str, Iterator[str]],
    index: int,
    leaf: bytes,
    where: str,
    *,
    origin: str,
    style: bundle.CsvStyle,
) -> None:
    """The next line of each rendering against entry `index`; `origin` is the log's (in the OCSF
    record), `style` what `entries.csv` has shown so far."""
    if not renderings:
        return
    obj = bundle.leaf_event(leaf)
    if obj is None:  # embedded, yet not an event: nothing can render it
        raise VerificationError(f"{where}: the leaf is not an event, but has renderings")
    for name, lines in renderings.items():
        line = next(lines, None)
        if name == bundle.CSV:
            problem = style.problem(line, index, obj)
        elif line != bundle.ocsf_line(index, obj, origin):
            problem = "differs from the proven leaf"
        else:
            problem = None
        if problem is not None:
            raise VerificationError(f"{name} (entry {index}): {problem} ({where})")


def _verify_consistency(
    d: Path, cp: Checkpoint, verifiers: Sequence[note.Verifier]
) -> list[Checkpoint]:
    """The older checkpoints each `consistency.jsonl` line proves the bundle's log extends."""
    path = d / bundle.CONSISTENCY
    if not path.is_file():
        return []
    with ExitStack() as stack:
        return _consistency_lines(_lines(path, stack), cp, verifiers)


def _consistency_lines(
    lines: Iterator[str], cp: Checkpoint, verifiers: Sequence[note.Verifier]
) -> list[Checkpoint]:
    olds: list[Checkpoint] = []
    for number, line in enumerate(lines, start=1):
        where = f"{bundle.CONSISTENCY} line {number}"
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict) or not isinstance(obj.get("proof"), list):
                raise VerificationError("not a consistency line (an object with a proof list)")
            old_note, proof_b64 = obj["old_checkpoint"], obj["proof"]
            if not isinstance(old_note, str):  # a list or object here was a traceback (a review)
                raise VerificationError("old_checkpoint is not a signed note")
            proof = [b64decode_strict(p, "proof hash") for p in proof_b64]
            if note.signed_by_any(old_note, verifiers):
                old = parse_checkpoint(note.open_note(old_note, verifiers)[0])
            else:
                # Signed by keys not given (the log's key before a rotation): unchecked here, but
                # the proof below still shows the trusted checkpoint extends this (size, root).
                old = parse_checkpoint(note.split_note(old_note)[0])
            if line != bundle.consistency_line(old_note, proof):
                raise VerificationError("line is not canonical")
            if old.origin != cp.origin:
                raise VerificationError("older checkpoint is from another log")
            merkle.verify_consistency(old.size, cp.size, old.root, cp.root, proof)
        except RecursionError:
            raise VerificationError(
                f"{where}: not a consistency line (nested too deeply)"
            ) from None
        except (ValueError, KeyError, TypeError, VerificationError) as exc:
            raise VerificationError(f"{where}: {exc}") from None
        olds.append(old)
    return olds


def _verify_tlog_proofs(d: Path, cp: Checkpoint, signed: str, hashes: dict[int, bytes]) -> int:
    folder = d / bundle.PROOFS
    if not folder.exists():
        return 0
    names = {p.name for p in folder.iterdir()}
    wanted = {bundle.proof_name(i) for i in hashes}
    if names != wanted:
        odd = sorted(names ^ wanted)[0]
        raise VerificationError(f"proofs/: {odd} is missing or unexpected")
    for index, h in hashes.items():
        where = f"proofs/{bundle.proof_name(index)}"
        try:
            proof = parse_tlog_proof(_read_text(folder / bundle.proof_name(index)))
            if proof.leaf_index != index or proof.signed_checkpoint != signed:
                raise VerificationError("index or checkpoint differs from the bundle's")
            if proof.extra is not None:  # kvguard writes none, and the manifest digests no proof
                raise VerificationError("an `extra` line, which kvguard's proofs never carry")
            merkle.verify_inclusion(index, cp.size, h, proof.proof, cp.root)
        except VerificationError as exc:
            raise VerificationError(f"{where}: {exc}") from None
    return len(hashes)
