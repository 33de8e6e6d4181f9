"""Retention and sharing policy.

Owns: policy models, their validation, the versioned policy store, and pure decision functions (admit,
may-reuse, expired, must-zeroize, quota). Never touches tensors and never writes the ledger directly (the
store offers a hook the ledger subscribes to).

Module map: `enums` (vocabularies), `models` (documents), `invariants` (cross-field rules), `loading`
(YAML/JSON with field-path errors), `decisions` (pure functions), `diff` (field differences between
two documents), `store` (versioned SQL store), `cli` (`kvguard policy ...`). The CLI is not
re-exported here, so importing policy does not import typer.
"""

from kvguard.policy.decisions import (
    NO_USAGE,
    BlockState,
    Decision,
    Reason,
    Usage,
    Verdict,
    admit,
    expired,
    may_reuse,
    may_share_prefix,
    must_zeroize,
    narrowed_groups,
    over_quota,
    private_scope,
    shared_prefix_tokens,
)
from kvguard.policy.enums import (
    MAX_REUSE,
    AuditLevel,
    Classification,
    LedgerUnavailable,
    QuotaFull,
    Reuse,
    Verify,
    ZeroizeOn,
)
from kvguard.policy.loading import load_policy_file, parse_policy
from kvguard.policy.models import (
    Offload,
    PolicySet,
    PrefixRef,
    Quota,
    Retention,
    ShareGroup,
    TenantPolicy,
    Zeroize,
    prefix_digest,
)
from kvguard.policy.store import PolicyChange, PolicyStore, PolicyVersion

__all__ = [
    "MAX_REUSE",
    "NO_USAGE",
    "AuditLevel",
    "BlockState",
    "Classification",
    "Decision",
    "LedgerUnavailable",
    "Offload",
    "PolicyChange",
    "PolicySet",
    "PolicyStore",
    "PolicyVersion",
    "PrefixRef",
    "Quota",
    "QuotaFull",
    "Reason",
    "Retention",
    "Reuse",
    "ShareGroup",
    "TenantPolicy",
    "Usage",
    "Verdict",
    "Verify",
    "Zeroize",
    "ZeroizeOn",
    "admit",
    "expired",
    "load_policy_file",
    "may_reuse",
    "may_share_prefix",
    "must_zeroize",
    "narrowed_groups",
    "over_quota",
    "parse_policy",
    "prefix_digest",
    "private_scope",
    "shared_prefix_tokens",
]
