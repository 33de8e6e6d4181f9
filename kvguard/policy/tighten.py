"""What a tenant_admin may change: only tighten the limits the admin set, never loosen them.

`loosened(limit, proposed)` lists every field where `proposed` is looser than `limit` (the tenant's
entry in the latest admin-written version); an empty list means the proposal only tightens or keeps.
Tighter means: more sensitive classification, narrower reuse, shorter TTL and idle limit, a quota no
larger (and present when the admin set one) and refused at the front end rather than waiting in the
engine once the admin chose that (`when_full`), zeroization no less often and verified no less, more
auditing, offload no more allowed (tier, budget, time in the tier, disk), and refusing new work
during a ledger outage once the admin chose that (`on_ledger_unavailable`). `enabled` and `groups`
are the admin's alone (checked by the API against the current entry). `RULED` names every field of
`TenantPolicy` and a test holds it to the model, so a new field cannot go unchecked.
"""

from __future__ import annotations

from typing import Final

from kvguard.policy.enums import (
    AuditLevel,
    Classification,
    LedgerUnavailable,
    QuotaFull,
    Verify,
    ZeroizeOn,
)
from kvguard.policy.models import TenantPolicy

_CLASSIFICATION: Final = list(Classification)  # public < internal < confidential < restricted
_VERIFY: Final = [Verify.NONE, Verify.SAMPLE, Verify.FULL]
_AUDIT: Final = [AuditLevel.MINIMAL, AuditLevel.STANDARD, AuditLevel.FULL]
_ZEROIZE_ON: Final = [ZeroizeOn.CROSS_SCOPE, ZeroizeOn.ALWAYS]
_WHEN_FULL: Final = [QuotaFull.WAIT, QuotaFull.REJECT]
_LEDGER: Final = [LedgerUnavailable.BLOCK, LedgerUnavailable.FAIL_CLOSED]
# Every field of a tenant's policy, as a dotted path: those `loosened` orders, and `enabled` and
# `groups` (the admin's alone; `loosened` also refuses re-enabling). tests/policy/test_tighten.py
# holds this to `TenantPolicy`'s fields.
RULED: Final = frozenset(
    {
        "classification",
        "reuse",
        "retention.ttl_s",
        "retention.idle_s",
        "quota.max_blocks",
        "quota.when_full",
        "zeroize.on_release",
        "zeroize.verify",
        "audit",
        "offload.allowed",
        "offload.max_bytes",
        "offload.ttl_s",
        "offload.disk",
        "on_ledger_unavailable",
        "enabled",
        "groups",
    }
)


def loosened(limit: TenantPolicy, proposed: TenantPolicy) -> list[str]:
    """The fields (dotted paths) where `proposed` loosens `limit`."""
    out = []
    if _CLASSIFICATION.index(proposed.classification) < _CLASSIFICATION.index(limit.classification):
        out.append("classification")
    if proposed.reuse.rank > limit.reuse.rank:
        out.append("reuse")
    if proposed.retention.ttl_s > limit.retention.ttl_s:
        out.append("retention.ttl_s")
    if proposed.retention.idle_s > limit.retention.idle_s:
        out.append("retention.idle_s")
    cap = limit.quota.max_blocks
    if cap is not None and (proposed.quota.max_blocks is None or proposed.quota.max_blocks > cap):
        out.append("quota.max_blocks")
    if _WHEN_FULL.index(proposed.quota.when_full) < _WHEN_FULL.index(limit.quota.when_full):
        out.append("quota.when_full")
    if _ZEROIZE_ON.index(proposed.zeroize.on_release) < _ZEROIZE_ON.index(limit.zeroize.on_release):
        out.append("zeroize.on_release")
    if _VERIFY.index(proposed.zeroize.verify) < _VERIFY.index(limit.zeroize.verify):
        out.append("zeroize.verify")
    if _AUDIT.index(proposed.audit) < _AUDIT.index(limit.audit):
        out.append("audit")
    out += _offload_loosened(limit, proposed)
    if _LEDGER.index(proposed.on_ledger_unavailable) < _LEDGER.index(limit.on_ledger_unavailable):
        out.append("on_ledger_unavailable")
    if proposed.enabled and not limit.enabled:
        out.append("enabled")
    return out


def _offload_loosened(limit: TenantPolicy, proposed: TenantPolicy) -> list[str]:
    out = []
    was, now = limit.offload, proposed.offload
    if now.allowed and not was.allowed:
        out.append("offload.allowed")
    if was.max_bytes is not None and (now.max_bytes is None or now.max_bytes > was.max_bytes):
        out.append("offload.max_bytes")
    if now.ttl_s > was.ttl_s:
        out.append("offload.ttl_s")
    if now.disk and not was.disk:
        out.append("offload.disk")
    return out
