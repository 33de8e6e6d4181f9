"""Erasure certificates: the format (version 1) and its offline verifier.

A certificate says that the KV cache blocks selected by one purge job were cleared (NIST SP 800-88
Rev. 1 "Clear": overwritten with zeros) on every engine that held them, in the layout of the
"Certificate of Sanitization" of SP 800-88 Appendix G, for the control NIST SP 800-53 SC-4
(information in shared system resources). The admin API issues it (`kvguard.api.certificates`);
docs/api.md shows an example. Its claims are backed by ledger entries carried in the certificate
itself, each with its exact leaf bytes and an RFC 9162 inclusion proof against one signed checkpoint.

The verifier key is deliberately *not* in the certificate: a document cannot vouch for itself. The
relying party passes the log's verifier key (`kvguard verify CERT.json --key VKEY`), obtained out of
band, as for export bundles.

Verification (`verify_certificate`), failing closed at the first problem with `VerificationError`:
1. the document is a version-1 certificate;
2. the checkpoint is a C2SP signed note by a trusted key, for the issuer's ledger origin;
3. every evidence entry's inclusion proof leads from its leaf to the checkpoint's root;
4. every leaf decodes (canonically) to an event of its stated role: the purge entries name this job
   and kind; exactly one request entry (every job has one: `purge.create` from the API and the
   command line, `tenant.disable`) names this job, requester and tenant tag and records
   `engines_expected`; the `job` claims (status `done`, `engines_expected` as the request
   recorded it and no more than the listed engines, `no_live_engines` exactly when none is
   listed) and the `selector` (the request's kind; a tenant tag and no value for tenant and
   session purges; for model and adapter purges a value whose SHA-256 the request recorded
   (`VALUE_FIELD`), and no tag) agree with the entries. A request entry written before it
   recorded these (`engines_expected`, `VALUE_FIELD`) fails: the ledger does not back the claim.
   No purge or key shred entry is dated more than `erasure.JOB_ENTRY_LEAD` before the request:
   job ids repeat when a control database is restored or recreated, and an earlier job's
   entries under the same number are not this job's (found by a review);
5. every block a purge entry quarantined is covered by a zeroize entry (`kvguard.audit.erasure`)
   that passed verification, and no zeroize entry is there for nothing;
6. every offload data key a purge entry says it must destroy (`tier_key_count`) has its `key.shred`
   entry of this job and engine after it, and no `key.shred` entry is there for nothing;
7. every claim the leaves can back (`CLAIMS`, the engines and their counts, the offload part
   `media.offload` and each engine's `offload`: `OFFLOAD_CLAIMS`, `ENGINE_OFFLOAD_CLAIMS`) equals
   what the leaves show; a certificate whose purges had no offload keys has no offload part. Claims
   the ledger does not hold (engine models, acknowledgement times) are reported values. Claims
   are compared type for type (`_same`): JSON `true` is not the integer 1.

Standard library and `cryptography` only, like the bundle verifier (it reuses the same checkpoint,
signed-note and Merkle functions).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvguard.audit import erasure, merkle, note
from kvguard.audit.checkpoint import Checkpoint, b64decode_strict, parse_checkpoint
from kvguard.errors import VerificationError

FORMAT: Final = "kvguard/erasure-certificate"
VERSION: Final = 1
ROLES: Final = ("request", "purge", "zeroize", "shred")
REQUEST_ACTIONS: Final = {"purge.create": "job_id", "tenant.disable": "purge_job_id"}
MAX_BYTES: Final = 64 << 20
# The request entry's record of a model or adapter purge's value: the hex SHA-256 of its UTF-8
# bytes. A digest, not the name, because a purge value may be longer (256 characters) than a
# ledger detail (200, `kvguard.audit.events.MAX_TEXT`); it binds the certificate's `selector.value`
# all the same. Tenant and session purges record none: a tenant or session id is G6 material, and
# a digest of one could be guessed back.
VALUE_FIELD: Final = "purge_value_sha256"

# Certificate field (dotted path) -> the `erasure.summary` value it must equal.
CLAIMS: Final = {
    "media.kv_cache_blocks.quarantined": "blocks_quarantined",
    "media.kv_cache_blocks.cleared": "blocks_quarantined",
    "media.kv_cache_blocks.active_deferred": "blocks_active_deferred",
    "media.kv_cache_blocks.bytes_cleared": "bytes_cleared",
    "sanitization.technique": "methods",
    "sanitization.verification.modes": "verify_modes",
    "sanitization.verification.result": "verification_result",
    "timestamps.purged_first": "purged_first",
    "timestamps.purged_last": "purged_last",
    "timestamps.zeroized_first": "zeroized_first",
    "timestamps.zeroized_last": "zeroized_last",
}
# Per-engine fields the leaves back (for engines named in their purge entries).
ENGINE_CLAIMS: Final = ("blocks_quarantined", "blocks_active_deferred", "bytes_cleared", "devices")
# The offload part (`media.offload`, present only when a purge entry had offload keys to destroy):
# each field must equal `erasure.offload_summary`'s; the rest of it (type, method) is reported text.
OFFLOAD_PATH: Final = "media.offload"
OFFLOAD_CLAIMS: Final = (
    "keys_destroyed",
    "entries_deleted",
    "bytes_deleted",
    "key_shred_entries",
    "shredded_first",
    "shredded_last",
)
# Each engine's `offload` (present only for engines whose key.shred entries the evidence holds).
ENGINE_OFFLOAD_CLAIMS: Final = (
    "keys_destroyed",
    "entries_deleted",
    "bytes_deleted",
    "key_shred_entries",
)


@dataclass(frozen=True)
class CertificateReport:
    job_id: int
    origin: str
    tree_size: int
    entries: int
    engines: int
    blocks_cleared: int
    offload_keys_destroyed: int = 0


def value_digest(value: str) -> str:
    """What a request entry records of a model or adapter purge's value (`VALUE_FIELD`)."""
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def recorded_value(kind: str, value: str) -> dict[str, str]:
    """What a purge's request entry records of its value (`kind`: `tenant`, `session`, `model`,
    `adapter`): the digest of a model's or adapter's name (`VALUE_FIELD`), which a certificate's
    `selector.value` must match; nothing of a tenant or session id (G6)."""
    return {VALUE_FIELD: value_digest(value)} if kind in ("model", "adapter") else {}


def _same(claimed: Any, shown: Any) -> bool:
    """Equal and of the same JSON type, lists item by item: in Python `True == 1` and `1 == 1.0`,
    so a plain `==` let `"version": true` or a count of `true` pass for the integer 1."""
    if isinstance(shown, list):
        return (
            isinstance(claimed, list)
            and len(claimed) == len(shown)
            and all(_same(c, v) for c, v in zip(claimed, shown, strict=True))
        )
    return type(claimed) is type(shown) and claimed == shown


def get_path(document: Mapping[str, Any], path: str) -> Any:
    value: Any = document
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise VerificationError(f"certificate has no {path}")
        value = value[part]
    return value


def set_path(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        document = document.setdefault(part, {})
    document[last] = value


class _DuplicateKeyError(Exception):
    """A JSON object naming one key twice: readers disagree on which value counts (the last here,
    the first in others), so a certificate must not have one."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateKeyError(json.dumps(key[:64]))
        document[key] = value
    return document


def load(path: str | Path) -> dict[str, Any]:
    """Read a certificate file (JSON object); VerificationError if it is not one."""
    p = Path(path)
    try:
        if p.stat().st_size > MAX_BYTES:
            raise VerificationError(f"{p.name} is larger than a certificate can be")
        document = json.loads(p.read_bytes().decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        raise VerificationError(f"{p.name}: the key {exc} appears twice in one object") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise VerificationError(f"{p.name} is not a readable JSON document") from None
    if not isinstance(document, dict):
        raise VerificationError(f"{p.name} is not a JSON object")
    return document


def verify_certificate(
    document: Mapping[str, Any], verifier_keys: Sequence[str], *, origin: str | None = None
) -> CertificateReport:
    """Run the steps of the module docstring; raise VerificationError at the first failure."""
    verifiers = [note.parse_verifier_key(k) for k in verifier_keys]
    if not verifiers:
        raise VerificationError("no verifier key given")
    try:
        return _verify(document, verifiers, origin)
    except (TypeError, KeyError, AttributeError, ValueError, RecursionError) as exc:
        # The checks above name what they expect; a field of a shape none of them foresaw must
        # still be an INVALID certificate, never a traceback (G7: fail closed).
        raise VerificationError(
            f"certificate is malformed (a field of an unexpected type: {type(exc).__name__})"
        ) from None


MEDIA_TYPE: Final = (
    "KV cache blocks (paged attention cache) in the device memory of LLM serving engines"
)
# What kvguard's clears are (every `block.zeroize` entry is one): fixed statements a certificate
# makes about them, checked as they are (a certificate claiming "Destroy" or "Degauss" is false).
SANITIZATION: Final[Mapping[str, str]] = {
    "method_type": "Clear",
    "method_used": "Overwrite with zeros",
    "method_details": (
        "Each block was held out of the engine's free pool (quarantined) and overwritten with zeros "
        "on its device, in every layer, before the engine could hand it to another owner; the clear "
        "was read back per the tenant's policy (verification modes) and recorded in the audit "
        "ledger."
    ),
    "destination": "Returned to the engine's free block pool for reuse",
}


def _verify(
    document: Mapping[str, Any], verifiers: Sequence[note.Verifier], origin: str | None
) -> CertificateReport:
    if document.get("format") != FORMAT or not _same(document.get("version"), VERSION):
        raise VerificationError(f"not a version-{VERSION} {FORMAT} document")
    cp = _checkpoint(document, verifiers, origin)
    if not _same(get_path(document, "evidence.tree_size"), cp.size):
        raise VerificationError("evidence.tree_size: not the size of the evidence's checkpoint")
    for key, statement in SANITIZATION.items():  # the rest of `sanitization` is in CLAIMS
        if get_path(document, f"sanitization.{key}") != statement:
            raise VerificationError(
                f"sanitization.{key}: not what kvguard's clears are (Clear, overwrite with zeros)"
            )
    if get_path(document, "media.type") != MEDIA_TYPE:
        raise VerificationError("media.type: not the KV cache blocks kvguard clears")
    entries = _proven_entries(document, cp)
    job_id = get_path(document, "job.job_id")
    if not isinstance(job_id, int) or isinstance(job_id, bool):
        raise VerificationError("job.job_id is not an integer")
    purges = [erasure.purge_entry(i, obj) for role, i, obj in entries if role == "purge"]
    zeroizes = [erasure.zeroize_entry(i, obj) for role, i, obj in entries if role == "zeroize"]
    shreds = [erasure.shred_entry(i, obj) for role, i, obj in entries if role == "shred"]
    requests = [(i, obj) for role, i, obj in entries if role == "request"]
    _check_purges(document, purges, job_id)
    _check_parts([(i, obj) for role, i, obj in entries if role == "purge"])
    for s in shreds:
        if s.command_id != job_id:
            raise VerificationError(f"entry {s.index}: a key shred of another job")
    if len(requests) != 1:
        raise VerificationError(
            f"evidence holds {len(requests)} request entries, not exactly one: every purge job "
            "has its request entry (purge.create or tenant.disable) in the ledger"
        )
    _engine_list(document)
    _check_request(document, *requests[0], job_id)
    _check_dates(requests[0], purges, shreds)
    _check_job(document, requests[0][1], purges)
    _check_selector(document, requests[0][1])
    coverage, offload = _cover(purges, zeroizes, shreds)
    shown = erasure.summary(purges, zeroizes, coverage)
    for path, key in CLAIMS.items():
        if not _same(get_path(document, path), shown[key]):
            raise VerificationError(f"{path}: the certificate's value is not what the entries show")
    shown_offload = erasure.offload_summary(purges, shreds, offload)
    _check_offload(document, shown_offload)
    # The id names the job and the checkpoint (docs/api.md): a certificate relabelled as another
    # job's, or as of another tree size, is not this one.
    if document.get("certificate_id") != f"{cp.origin}/purges/{job_id}/certificate@{cp.size}":
        raise VerificationError(
            "certificate_id: not <origin>/purges/<job id>/certificate@<tree size> of this evidence"
        )
    engines = _check_engines(
        document,
        erasure.engine_facts(purges, zeroizes, coverage),
        erasure.offload_engine_facts(shreds, offload),
    )
    return CertificateReport(
        job_id,
        cp.origin,
        cp.size,
        len(entries),
        engines,
        shown["blocks_quarantined"],
        shown_offload["keys_destroyed"] if shown_offload else 0,
    )


def _cover(
    purges: Sequence[erasure.PurgeEntry],
    zeroizes: Sequence[erasure.ZeroizeEntry],
    shreds: Sequence[erasure.ShredEntry],
) -> tuple[erasure.Coverage, erasure.OffloadCoverage]:
    """Steps 5 and 6: every block cleared and every offload key shredded, no entry for nothing."""
    coverage = erasure.cover(purges, zeroizes)
    if not coverage.complete:
        first = min(coverage.missing)
        raise VerificationError(
            f"entry {first}: {len(coverage.missing[first])} quarantined blocks have no zeroize entry"
        )
    idle = {z.index for z in zeroizes} - set(coverage.zeroize_indices())
    if idle:
        raise VerificationError(f"entry {min(idle)}: a zeroize entry that covers no purged block")
    offload = erasure.cover_offload(purges, shreds)
    if not offload.complete:
        first = min(offload.missing)
        raise VerificationError(
            f"entry {first}: offload data keys without a key.shred entry: {offload.missing[first]}"
        )
    idle = {s.index for s in shreds} - set(offload.shred_indices())
    if idle:
        raise VerificationError(f"entry {min(idle)}: a key.shred entry that no purge entry needs")
    return coverage, offload


def _checkpoint(
    document: Mapping[str, Any], verifiers: Sequence[note.Verifier], origin: str | None
) -> Checkpoint:
    signed = get_path(document, "evidence.checkpoint")
    if not isinstance(signed, str):
        raise VerificationError("evidence.checkpoint is not a signed note")
    try:
        cp = parse_checkpoint(note.open_note(signed, verifiers)[0])
    except VerificationError as exc:
        raise VerificationError(f"evidence.checkpoint: {exc}") from None
    if cp.origin != get_path(document, "issuer.ledger_origin"):
        raise VerificationError("evidence.checkpoint: not from the issuer's ledger origin")
    if origin is not None and cp.origin != origin:
        raise VerificationError(
            f"evidence.checkpoint: origin is {cp.origin!r}, expected {origin!r}"
        )
    return cp


def _proven_entries(
    document: Mapping[str, Any], cp: Checkpoint
) -> list[tuple[str, int, dict[str, Any]]]:
    """Each evidence entry as (role, index, leaf object), after its inclusion proof verified."""
    raw = get_path(document, "evidence.entries")
    if not isinstance(raw, list):
        raise VerificationError("evidence.entries is not a list")
    out: list[tuple[str, int, dict[str, Any]]] = []
    seen: set[int] = set()
    for number, item in enumerate(raw):
        where = f"evidence.entries[{number}]"
        try:
            role, index, leaf_b64, proof_b64 = (
                item[k] for k in ("role", "index", "leaf", "inclusion_proof")
            )
        except (KeyError, TypeError):
            raise VerificationError(f"{where}: not an evidence entry") from None
        if role not in ROLES or not isinstance(index, int) or isinstance(index, bool):
            raise VerificationError(f"{where}: unknown role or non-integer index")
        if index in seen or not isinstance(proof_b64, list):
            raise VerificationError(f"{where}: repeated index or no proof list")
        seen.add(index)
        leaf = b64decode_strict(str(leaf_b64), f"{where}: leaf")
        proof = [b64decode_strict(str(h), f"{where}: proof hash") for h in proof_b64]
        try:
            merkle.verify_inclusion(index, cp.size, merkle.leaf_hash(leaf), proof, cp.root)
        except VerificationError as exc:
            raise VerificationError(f"{where} (entry {index}): {exc}") from None
        out.append((role, index, erasure.parse_leaf(leaf)))
    return out


def _check_purges(
    document: Mapping[str, Any], purges: Sequence[erasure.PurgeEntry], job_id: int
) -> None:
    kind = f"{get_path(document, 'selector.kind')}.purge"
    for p in purges:
        if p.command_id != job_id or p.kind != kind:
            raise VerificationError(f"entry {p.index}: a purge of another job or kind")


def _check_parts(purges: Sequence[tuple[int, dict[str, Any]]]) -> None:
    """A purge entry split into parts (`part` k of `parts`: more block ids than one entry holds) is
    evidence only whole: every part of it, once each, all naming the same count. Parts of one
    purge share the engine and the time (`ledger_bridge.to_audit_events`); leaving one out would
    hide blocks the purge quarantined, whose clears are then never asked for."""
    groups: dict[tuple[object, object], list[tuple[int, object, object]]] = {}
    for index, obj in purges:
        details = obj["details"]
        key = (details.get("engine_id"), obj.get("ts"))
        groups.setdefault(key, []).append((index, details.get("part"), details.get("parts")))
    for members in groups.values():
        if len(members) == 1 and members[0][1:] == (None, None):
            continue  # one entry, not split
        counts = {count for _, _, count in members}
        count = next(iter(counts))
        numbers = sorted(n for _, n, _ in members if isinstance(n, int) and not isinstance(n, bool))
        if not (
            len(counts) == 1
            and isinstance(count, int)
            and not isinstance(count, bool)
            and len(numbers) == len(members)
            and numbers == list(range(1, count + 1))
        ):
            first = min(index for index, _, _ in members)
            raise VerificationError(
                f"entry {first}: a purge entry split into parts is not carried whole (each of its "
                "parts, once)"
            )


def _check_request(
    document: Mapping[str, Any], index: int, obj: dict[str, Any], job_id: int
) -> None:
    """The `admin.action` entry that created the job: same job, requester and tenant tag, and
    the number of engines live at the request."""
    details = obj["details"]
    field = REQUEST_ACTIONS.get(details.get("action", ""))
    if obj.get("kind") != "admin.action" or field is None or details.get("outcome") != "ok":
        raise VerificationError(f"entry {index}: not a successful purge request")
    requested = details.get(field)
    if not isinstance(requested, int) or isinstance(requested, bool) or requested != job_id:
        raise VerificationError(f"entry {index}: requested another job")
    if details.get("principal") != get_path(document, "requested_by.principal"):
        raise VerificationError(f"entry {index}: requested by someone else")
    tag = get_path(document, "selector").get("tenant_tag")
    if tag is not None and obj.get("scope_tag") != tag:
        raise VerificationError(f"entry {index}: about another tenant")
    expected = details.get("engines_expected")
    if not isinstance(expected, int) or isinstance(expected, bool) or expected < 0:
        # Without the count a certificate that leaves out a whole engine (its entries and its
        # figures) is self-consistent: fail closed rather than certify what the ledger cannot.
        raise VerificationError(
            f"entry {index}: the request entry does not record engines_expected (written before "
            "kvguard recorded it): the ledger cannot show that every engine live at the request "
            "is listed"
        )
    if len(_engine_list(document)) < expected:
        raise VerificationError(f"entry {index}: fewer engines than were live at the request")


def _check_dates(
    request: tuple[int, dict[str, Any]],
    purges: Sequence[erasure.PurgeEntry],
    shreds: Sequence[erasure.ShredEntry],
) -> None:
    """No purge or key shred entry dated before the request less `erasure.JOB_ENTRY_LEAD` (what
    the API's evidence search accepts): one that old is an earlier job's under the same id."""
    index, obj = request
    earliest = erasure.instant(obj["ts"], f"entry {index}") - erasure.JOB_ENTRY_LEAD
    dated = [(p.index, p.ts) for p in purges] + [(s.index, s.ts) for s in shreds]
    for at, ts in dated:
        if erasure.instant(ts, f"entry {at}") < earliest:
            raise VerificationError(
                f"entry {at}: dated before its job was requested (entry {index}): an earlier "
                "job's under the same id"
            )


def _check_job(
    document: Mapping[str, Any], request: dict[str, Any], purges: Sequence[erasure.PurgeEntry]
) -> None:
    """`job.status`, `engines_expected` and `no_live_engines` against the leaves: a certificate is
    issued only for a `done` job; the request entry (`_check_request` made sure it records it) says
    how many engines were expected, and every expected engine of a done job is listed; "no live
    engines" means no engine is listed and no purge entry exists."""
    job = get_path(document, "job")
    if not isinstance(job, Mapping):
        raise VerificationError("job is not an object")
    if job.get("status") != "done":
        raise VerificationError("job.status: a certificate is issued only for a done job")
    listed = len(_engine_list(document))
    claimed = job.get("engines_expected")
    if not isinstance(claimed, int) or isinstance(claimed, bool) or not 0 <= claimed <= listed:
        raise VerificationError(
            "job.engines_expected: not a count of the listed engines (a done job lists every "
            "engine it expected)"
        )
    if not _same(claimed, request["details"].get("engines_expected")):
        raise VerificationError(
            "job.engines_expected: the certificate's value is not what the request entry shows"
        )
    none_live = job.get("no_live_engines")
    if none_live is not (listed == 0 and not purges):
        raise VerificationError(
            "job.no_live_engines: the certificate's value is not what the entries show"
        )


def _check_selector(document: Mapping[str, Any], request: dict[str, Any]) -> None:
    """`selector` against the purge and request entries: the kind (checked against the purge
    entries by `_check_purges`) is the request's; tenant and session purges name the request's
    tenant tag (`_check_request`) and disclose no value; model and adapter purges name the value
    whose digest the request recorded (`VALUE_FIELD`), and no tenant."""
    sel = get_path(document, "selector")
    if not isinstance(sel, Mapping):
        raise VerificationError("selector is not an object")
    kind = sel.get("kind")
    details = request["details"]
    requested = "tenant" if details.get("action") == "tenant.disable" else details.get("purge_kind")
    if requested is not None and kind != requested:
        raise VerificationError("selector.kind: not the kind the request entry shows")
    tag, value = sel.get("tenant_tag"), sel.get("value")
    if kind in ("tenant", "session"):
        if not isinstance(tag, str) or value is not None:
            raise VerificationError(
                f"selector: a {kind} purge names its tenant tag and discloses no value"
            )
    elif kind in ("model", "adapter"):
        if tag is not None or not isinstance(value, str) or not value:
            raise VerificationError(f"selector: a {kind} purge names its value and no tenant tag")
        _check_value(value, details)
    else:
        raise VerificationError("selector.kind: not a purge kind")
    disclosed = sel.get("value_disclosed")
    if disclosed is not None and disclosed is not (kind in ("model", "adapter")):
        raise VerificationError("selector.value_disclosed: not what the kind allows")


def _check_value(value: str, details: Mapping[str, Any]) -> None:
    """A model or adapter purge's value is the one its request entry recorded (`VALUE_FIELD`):
    without it, a certificate could be relabelled as another model's or adapter's purge."""
    recorded = details.get(VALUE_FIELD)
    if recorded is None:
        raise VerificationError(
            "selector.value: not recorded in the ledger for this purge (its request entry was "
            f"written before kvguard recorded {VALUE_FIELD}), so the ledger cannot back it"
        )
    if recorded != value_digest(value):
        raise VerificationError("selector.value: not the value the request entry records")


def _engine_list(document: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """`media.engines`, checked to be a list of engines with string (or absent) ids."""
    listed = get_path(document, "media.engines")
    if not isinstance(listed, list) or not all(isinstance(e, Mapping) for e in listed):
        raise VerificationError("media.engines is not a list of engines")
    if not all(isinstance(e.get("engine_id"), (str, type(None))) for e in listed):
        raise VerificationError("media.engines: an engine_id is not a string")
    return listed


def _check_offload(document: Mapping[str, Any], shown: Mapping[str, Any] | None) -> None:
    """`media.offload` is there exactly when the purges had offload keys, with the leaves' figures."""
    media = get_path(document, "media")
    if not isinstance(media, Mapping):
        raise VerificationError("media is not an object")
    if shown is None:
        if "offload" in media:
            raise VerificationError(
                f"{OFFLOAD_PATH}: claimed, but no purge entry had offload keys to destroy"
            )
        return
    claimed = get_path(document, OFFLOAD_PATH)
    if not isinstance(claimed, Mapping):
        raise VerificationError(f"{OFFLOAD_PATH} is not an object")
    for name in OFFLOAD_CLAIMS:
        if not _same(claimed.get(name), shown[name]):
            raise VerificationError(
                f"{OFFLOAD_PATH}.{name}: the certificate's value is not what the entries show"
            )


def _check_engine_offload(
    engine_id: str, claimed: Mapping[str, Any], shown: Mapping[str, Any] | None
) -> None:
    value = claimed.get("offload")
    if shown is None:
        if value is not None:
            raise VerificationError(f"engine {engine_id}: offload is not what the entries show")
        return
    if not isinstance(value, Mapping) or any(
        not _same(value.get(name), shown[name]) for name in ENGINE_OFFLOAD_CLAIMS
    ):
        raise VerificationError(f"engine {engine_id}: offload is not what the entries show")


def _check_engines(
    document: Mapping[str, Any],
    facts: dict[str | None, dict[str, Any]],
    offload: dict[str | None, dict[str, Any]],
) -> int:
    """Engines named in purge entries match one certificate engine each, field for field (their
    offload part included); the rest of the certificate's engines (older engines record no id)
    number the engines the anonymous purge entries stand for (`erasure.engines_in`: the parts of
    one split entry are one engine)."""
    listed = _engine_list(document)
    ids = [e.get("engine_id") for e in listed]
    if len(set(ids)) != len(ids):
        raise VerificationError("media.engines names an engine twice")
    by_id = {e.get("engine_id"): e for e in listed}
    for engine_id, shown in facts.items():
        if engine_id is None:
            continue
        claimed = by_id.pop(engine_id, None)
        if claimed is None:
            raise VerificationError(f"engine {engine_id}: has purge entries but is not listed")
        for name in ENGINE_CLAIMS:
            if not _same(claimed.get(name), shown[name]):
                raise VerificationError(f"engine {engine_id}: {name} is not what the entries show")
        _check_engine_offload(engine_id, claimed, offload.get(engine_id))
    anonymous = facts.get(None, {}).get("engines", 0)
    if len(by_id) != anonymous:
        raise VerificationError("media.engines: an engine without a purge entry, or one missing")
    return len(listed)
