"""Request and response bodies of `/v1/purges`, including the documented shape of an erasure
certificate (the format itself, and what the verifier checks, is `kvguard.audit.certificate`)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvguard.api.purge_jobs import JobReport, PurgeEngineState, PurgeStatus
from kvguard.api.text import PlainLine
from kvguard.control.commands import PurgeKind
from kvguard.control.tenants import TENANT_ID_PATTERN

_TENANT_ID = re.compile(TENANT_ID_PATTERN)
_TENANT_KINDS = (PurgeKind.TENANT, PurgeKind.SESSION)


class PurgeCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: PurgeKind
    value: PlainLine = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="The session, tenant, model or adapter id",
    )
    tenant_id: str | None = Field(
        default=None,
        max_length=128,
        validate_default=True,
        description="The session's tenant: required for a session purge, unused otherwise",
    )

    @field_validator("value")
    @classmethod
    def _tenant_value(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("kind") is PurgeKind.TENANT and not _TENANT_ID.fullmatch(value):
            raise ValueError("a tenant purge's value is a tenant id")
        return value

    @field_validator("tenant_id")
    @classmethod
    def _tenant_for_kind(cls, tenant_id: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")
        if tenant_id is not None and not _TENANT_ID.fullmatch(tenant_id):
            raise ValueError("not a tenant id")
        if kind is PurgeKind.SESSION and tenant_id is None:
            raise ValueError("required for a session purge")
        if kind is PurgeKind.TENANT and tenant_id not in (None, info.data.get("value")):
            raise ValueError("a tenant purge's tenant_id, if given, is its value")
        if kind in (PurgeKind.MODEL, PurgeKind.ADAPTER) and tenant_id is not None:
            raise ValueError("model and adapter purges apply to every tenant; leave it out")
        return tenant_id

    def tenant(self) -> str | None:
        """The tenant this purge is confined to (None: model and adapter purges)."""
        if self.kind not in _TENANT_KINDS:
            return None
        return self.value if self.kind is PurgeKind.TENANT else self.tenant_id


class PurgeCreated(BaseModel):
    job_id: int
    status: PurgeStatus
    engines_expected: int = Field(description="Engines live now, which the job waits for")


class EngineProgressPublic(BaseModel):
    engine_id: str
    expected: bool = Field(description="Live when the job was created, so waited for")
    state: PurgeEngineState
    model: str | None
    acknowledged_at: float | None
    blocks_quarantined: int | None = Field(description="Cached blocks quarantined for clearing")
    blocks_active_deferred: int | None = Field(
        description="Blocks in use by running requests: cleared when those requests end"
    )
    offload_keys: int | None = Field(
        default=None,
        description="Offload data keys its purge entry says the purge must destroy (engines "
        "with an offload tier; null: none)",
    )
    offload_keys_destroyed: int | None = Field(
        default=None, description="Of those, the keys whose key.shred entry is in the ledger"
    )
    missing: list[str] = Field(
        default_factory=list,
        description="What this engine's part still lacks (acknowledgement, its purge entry, "
        "zeroize entries, key.shred entries); empty once done",
    )


class PurgeJobPublic(BaseModel):
    job_id: int
    kind: PurgeKind
    value: str
    tenant_id: str | None
    requested_by: str
    created_at: float
    status: PurgeStatus
    no_live_engines: bool = Field(description="No engine was live at creation: nothing to clear")
    engines_expected: int
    engines: list[EngineProgressPublic]
    blocks_quarantined: int
    blocks_active_deferred: int
    blocks_cleared: int = Field(description="Quarantined blocks whose clear is in the ledger")
    certificate: str | None = Field(description="Where to fetch the certificate once done")

    @classmethod
    def of(cls, report: JobReport) -> PurgeJobPublic:
        job = report.job
        done = report.status is PurgeStatus.DONE
        return cls(
            job_id=job.job_id,
            kind=job.kind,
            value=job.value,
            tenant_id=job.tenant_id,
            requested_by=job.requested_by,
            created_at=job.created_at,
            status=report.status,
            no_live_engines=report.no_live_engines,
            engines_expected=report.engines_expected,
            engines=[
                EngineProgressPublic.model_validate(e, from_attributes=True) for e in report.engines
            ],
            blocks_quarantined=report.total("blocks_quarantined"),
            blocks_active_deferred=report.total("blocks_active_deferred"),
            blocks_cleared=len(report.evidence.coverage.links),
            certificate=f"/v1/purges/{job.job_id}/certificate" if done else None,
        )


class PurgeJobPage(BaseModel):
    jobs: list[PurgeJobPublic]
    next_before: int | None = Field(description="Pass as `before` for the next page")


# --- the erasure certificate (version 1) ------------------------------------------------------------


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CertIssuer(_Doc):
    ledger_origin: str
    software: str


class CertRequester(_Doc):
    principal: str


class CertJob(_Doc):
    job_id: int
    status: PurgeStatus
    engines_expected: int
    no_live_engines: bool


class CertSelector(_Doc):
    kind: PurgeKind
    tenant_tag: str | None = Field(description="The tenant's public pseudonym (tenant, session)")
    value: str | None = Field(
        description="Model or adapter id; tenant and session ids are withheld"
    )
    value_disclosed: bool


class CertEngineOffload(_Doc):
    keys_destroyed: int = Field(description="Offload data keys destroyed (key.shred entries)")
    entries_deleted: int = Field(description="Ciphertexts deleted with them")
    bytes_deleted: int
    key_shred_entries: list[int] = Field(description="Ledger indices of the key.shred entries")


class CertOffload(CertEngineOffload):
    type: str
    method_used: str = Field(description="Cryptographic erase")
    method_details: str
    shredded_first: str | None
    shredded_last: str | None


class CertEngine(_Doc):
    engine_id: str
    model: str | None
    acknowledged_at: str | None
    blocks_quarantined: int | None
    blocks_active_deferred: int | None
    bytes_cleared: int | None
    devices: list[str]
    offload: CertEngineOffload | None = Field(
        default=None, description="Only for engines whose key.shred entries are evidence"
    )


class CertBlocks(_Doc):
    quarantined: int
    cleared: int
    active_deferred: int
    bytes_cleared: int


class CertMedia(_Doc):
    type: str
    engines: list[CertEngine]
    kv_cache_blocks: CertBlocks
    offload: CertOffload | None = Field(
        default=None,
        description="Encrypted copies in offload tiers, crypto-shredded: only when the purge "
        "had offload keys to destroy",
    )


class CertVerification(_Doc):
    modes: list[str] = Field(description="Read-back modes of the clears: none, sample, full")
    result: str = Field(description="passed, partial, not_verified or nothing_to_clear")


class CertSanitization(_Doc):
    method_type: str = Field(description="SP 800-88 category: Clear")
    method_used: str
    method_details: str
    technique: list[str] = Field(description="Zeroization executors that cleared the blocks")
    verification: CertVerification
    destination: str


class CertTimestamps(_Doc):
    requested: str | None
    acknowledged_first: str | None
    acknowledged_last: str | None
    purged_first: str | None
    purged_last: str | None
    zeroized_first: str | None
    zeroized_last: str | None


class CertEntry(_Doc):
    role: str = Field(description="request, purge, zeroize or shred")
    index: int
    leaf: str = Field(description="The exact leaf bytes, base64")
    inclusion_proof: list[str]


class CertEvidence(_Doc):
    checkpoint: str = Field(description="The signed C2SP checkpoint every proof is against")
    tree_size: int
    entries: list[CertEntry]


class ErasureCertificate(_Doc):
    format: str
    version: int
    certificate_id: str
    issued_at: str
    standards: list[str]
    issuer: CertIssuer
    requested_by: CertRequester
    job: CertJob
    selector: CertSelector
    media: CertMedia
    sanitization: CertSanitization
    timestamps: CertTimestamps
    notes: list[str]
    evidence: CertEvidence
    verify: dict[str, str]
