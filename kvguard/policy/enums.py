"""The closed vocabularies of a policy document, and how sharing units are ordered."""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from kvguard.isolation.scope import Share


class Classification(StrEnum):
    """How sensitive the tenant's prompts are. Bounds `reuse` and `zeroize` (see MAX_REUSE)."""

    PUBLIC = "public"
    INTERNAL = "internal"
    CONFIDENTIAL = "confidential"
    RESTRICTED = "restricted"


class Reuse(StrEnum):
    """The widest sharing unit a tenant's cached KV state may be reused in, narrowest first."""

    NONE = "none"
    SESSION = "session"
    TENANT = "tenant"
    GROUP = "group"
    PUBLIC = "public"

    @property
    def rank(self) -> int:
        return _REUSE_ORDER.index(self)

    def allows(self, share: Share) -> bool:
        """True when a scope shared at `share` is within this allowance."""
        return self.rank >= Reuse(share.value).rank


_REUSE_ORDER: Final = (Reuse.NONE, Reuse.SESSION, Reuse.TENANT, Reuse.GROUP, Reuse.PUBLIC)

# Public sharing lets anyone with the same prefix observe a cache hit (a timing side channel), so only
# data that is not confidential may be shared that widely; restricted data is never shared at all.
MAX_REUSE: Final = {
    Classification.PUBLIC: Reuse.PUBLIC,
    Classification.INTERNAL: Reuse.PUBLIC,
    Classification.CONFIDENTIAL: Reuse.GROUP,
    Classification.RESTRICTED: Reuse.NONE,
}


class ZeroizeOn(StrEnum):
    """When a released block is zeroized: always, or only when it changes reuse domain."""

    ALWAYS = "always"
    CROSS_SCOPE = "cross_scope"


class Verify(StrEnum):
    """How zeroization is checked: not at all, a sampled read-back, or a read-back of every block."""

    NONE = "none"
    SAMPLE = "sample"
    FULL = "full"


class AuditLevel(StrEnum):
    """Which custody transitions go to the ledger (docs/policy.md lists the events per level)."""

    MINIMAL = "minimal"
    STANDARD = "standard"
    FULL = "full"


class QuotaFull(StrEnum):
    """What happens to a request that would take its tenant's running work past `quota.max_blocks`:
    it waits in the engine's queue until the tenant's own requests leave room, or the front end
    refuses it at once (429) so the client can back off or shed load (issue 10, item 6)."""

    WAIT = "wait"
    REJECT = "reject"


class LedgerUnavailable(StrEnum):
    """What admission does when the ledger cannot take entries (G7): refuse, or hold requests back."""

    FAIL_CLOSED = "fail_closed"
    BLOCK = "block"
