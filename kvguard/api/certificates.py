"""Issue the erasure certificate of a finished purge job (format: `kvguard.audit.certificate`).

Everything the ledger can back is taken from the ledger entries themselves, through the same
`kvguard.audit.erasure` functions the offline verifier runs, so a certificate this module issues
verifies by construction. The rest (when the job was requested and acknowledged, the engines'
models) comes from the database and is labelled as reported.

What a certificate discloses (G6): the tenant only by its `tt_` tag, never its id; a session purge
names no session id (a certificate may be shown to third parties; the job record keeps it for those
allowed to read it); model and adapter purges name the model or adapter, which are the operator's
catalogue names. The evidence leaves carry ids, counts, scope tags and zeroization facts only; the
erasable payloads of the ledger (where tenant ids live) are never included.

Engines with an offload tier (issue 15) crypto-shred the encrypted copies a purge selects: such a
certificate also has an offload part (`media.offload`, and `offload` on each of those engines) with
the figures of the `key.shred` entries it carries. A certificate of a purge that had no offload keys
to destroy has none, so it is exactly what it was before offload tiers existed.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any, Final

from kvguard import __version__
from kvguard.api.purge_jobs import JobReport, PurgeJob
from kvguard.api.services import Services
from kvguard.audit import erasure
from kvguard.audit.certificate import (
    CLAIMS,
    ENGINE_CLAIMS,
    ENGINE_OFFLOAD_CLAIMS,
    FORMAT,
    MEDIA_TYPE,
    OFFLOAD_CLAIMS,
    OFFLOAD_PATH,
    SANITIZATION,
    VERSION,
    set_path,
)
from kvguard.audit.erasure_query import prove
from kvguard.control.commands import PurgeKind

STANDARDS: Final = (
    "NIST SP 800-88 Rev. 1, Appendix G: Certificate of Sanitization",
    "NIST SP 800-53 Rev. 5, SC-4: Information in Shared System Resources",
)
OFFLOAD_MEDIA_TYPE: Final = (
    "Encrypted copies of KV cache blocks in the offload tiers (host memory, local disk) of LLM "
    "serving engines"
)
OFFLOAD_METHOD: Final = "Cryptographic erase"
OFFLOAD_METHOD_DETAILS: Final = (
    "Each copy was encrypted (AES-256-GCM) under a data key of its reuse domain that existed only "
    "in the engine's memory; the purge destroyed the key of every domain it selected (its epoch "
    "secret overwritten, so the key cannot be derived again from anything kvguard holds) and deleted "
    "the domain's ciphertexts; each destroyed key is a key.shred entry in the audit ledger."
)


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def selector(services: Services, job: PurgeJob) -> dict[str, Any]:
    """What was purged, disclosed as little as the certificate's purpose allows (module docstring)."""
    if job.kind in (PurgeKind.TENANT, PurgeKind.SESSION):
        assert job.tenant_id is not None  # a tenant or session purge always names its tenant
        return {
            "kind": job.kind.value,
            "tenant_tag": services.deriver.tenant_tag(job.tenant_id),
            "value": None,
            "value_disclosed": False,
        }
    return {"kind": job.kind.value, "tenant_tag": None, "value": job.value, "value_disclosed": True}


def _engines(
    report: JobReport,
    facts: dict[str | None, dict[str, Any]],
    offload: dict[str | None, dict[str, Any]],
) -> list[dict[str, Any]]:
    out = []
    for e in report.engines:
        shown = facts.get(e.engine_id)
        entry: dict[str, Any] = {
            "engine_id": e.engine_id,
            "model": e.model,
            "acknowledged_at": _iso(e.acknowledged_at),
            "blocks_quarantined": e.blocks_quarantined,
            "blocks_active_deferred": e.blocks_active_deferred,
            "bytes_cleared": None,
            "devices": [],
        }
        if shown is not None:  # named in its purge entries: the ledger's figures
            entry.update({name: shown[name] for name in ENGINE_CLAIMS})
        shredded = offload.get(e.engine_id)
        if shredded is not None:  # only engines whose key.shred entries are evidence
            entry["offload"] = {name: shredded[name] for name in ENGINE_OFFLOAD_CLAIMS}
        out.append(entry)
    return out


def _offload(shown: dict[str, Any]) -> dict[str, Any]:
    """The certificate's offload part (`media.offload`): reported text, then the leaves' figures."""
    return {
        "type": OFFLOAD_MEDIA_TYPE,
        "method_used": OFFLOAD_METHOD,
        "method_details": OFFLOAD_METHOD_DETAILS,
        **{name: shown[name] for name in OFFLOAD_CLAIMS},
    }


def _notes(report: JobReport, deferred: int, offload: dict[str, Any] | None) -> list[str]:
    notes = []
    if report.no_live_engines:
        notes.append("No engine was live when the job was created: no KV cache held data to clear.")
    if deferred:
        notes.append(
            f"Blocks in use by running requests when the purge ran ({deferred}) were marked to be "
            "quarantined and cleared when those requests end, like every released block; they are "
            "counted here without being linked block by block."
        )
    if offload is not None:
        notes.append(
            "Encrypted copies in the engines' offload tiers were crypto-shredded (media.offload): "
            f"data keys destroyed: {offload['keys_destroyed']}; ciphertexts deleted with them: "
            f"{offload['entries_deleted']} ({offload['bytes_deleted']} bytes)."
        )
    notes.append(
        "Request and acknowledgement times and engine models are reported from the control "
        "database; every other figure is derived from the evidence entries."
    )
    return notes


def _evidence(report: JobReport, services: Services) -> dict[str, Any]:
    ev = report.evidence
    proven = prove(services.ledger, ev.indices())
    roles = {p.index: "purge" for p in ev.purges} | {z.index: "zeroize" for z in ev.zeroizes}
    roles |= {s.index: "shred" for s in ev.shreds}
    if ev.request is not None:
        roles[ev.request] = "request"
    entries = [
        {
            "role": roles[i],
            "index": i,
            "leaf": base64.b64encode(ev.leaves[i]).decode(),
            "inclusion_proof": [base64.b64encode(h).decode() for h in proven.proofs[i]],
        }
        for i in ev.indices()
    ]
    return {"checkpoint": proven.checkpoint, "tree_size": proven.tree_size, "entries": entries}


def _requested(report: JobReport) -> dict[str, Any]:
    """The request entry's details (the verifier checks the certificate against them), or none."""
    ev = report.evidence
    if ev.request is None:
        return {}
    return dict(erasure.parse_leaf(ev.leaves[ev.request])["details"])


def _engines_expected(report: JobReport, requested: dict[str, Any]) -> int:
    """What the request entry recorded (the verifier compares the two), else the live count:
    the registry's count now can differ from the one taken when the job was created."""
    count = requested.get("engines_expected")
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    return report.engines_expected


def _principal(job: PurgeJob, requested: dict[str, Any]) -> str:
    """Who asked, as the request entry names them (the verifier compares the two): the job row
    may spell it otherwise (a job queued before `kvguard purge` stored `cli:<by>` holds `<by>`;
    the ledger keeps 200 characters of a longer name)."""
    principal = requested.get("principal")
    return principal if isinstance(principal, str) else job.requested_by


def issue(services: Services, report: JobReport) -> dict[str, Any]:
    """The certificate of a `done` job (the caller checks the status)."""
    ev, job = report.evidence, report.job
    shown = erasure.summary(ev.purges, ev.zeroizes, ev.coverage)
    facts = erasure.engine_facts(ev.purges, ev.zeroizes, ev.coverage)
    offload = erasure.offload_summary(ev.purges, ev.shreds, ev.offload)
    offload_facts = erasure.offload_engine_facts(ev.shreds, ev.offload)
    evidence = _evidence(report, services)
    origin = services.ledger.origin
    acks = [e.acknowledged_at for e in report.engines if e.acknowledged_at is not None]
    requested = _requested(report)
    document: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "certificate_id": f"{origin}/purges/{job.job_id}/certificate@{evidence['tree_size']}",
        "issued_at": _iso(services.clock()),
        "standards": list(STANDARDS),
        "issuer": {"ledger_origin": origin, "software": f"kvguard {__version__}"},
        "requested_by": {"principal": _principal(job, requested)},
        "job": {
            "job_id": job.job_id,
            "status": report.status.value,
            "engines_expected": _engines_expected(report, requested),
            "no_live_engines": report.no_live_engines,
        },
        "selector": selector(services, job),
        "media": {"type": MEDIA_TYPE, "engines": _engines(report, facts, offload_facts)},
        "sanitization": dict(SANITIZATION),
        "timestamps": {
            "requested": _iso(job.created_at),
            "acknowledged_first": _iso(min(acks, default=None)),
            "acknowledged_last": _iso(max(acks, default=None)),
        },
        "notes": _notes(report, shown["blocks_active_deferred"], offload),
        "evidence": evidence,
        "verify": {
            "command": f"kvguard verify <this file> --key <verifier key of {origin}> --origin {origin}",
            "trust": "The verifier key is not in the certificate: get it from the log operator.",
        },
    }
    for path, key in CLAIMS.items():
        set_path(document, path, shown[key])
    if offload is not None:
        set_path(document, OFFLOAD_PATH, _offload(offload))
    return document
