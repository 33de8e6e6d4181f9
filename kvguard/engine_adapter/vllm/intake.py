"""How a request the engine did not get from kvguard's front end is held: private and uncached.

Two cases reach the scheduler without a usable scope: ungoverned traffic (no envelope) gets a private,
single-request scope; a request whose salt the server did not derive, or that policy refuses the cache,
keeps its scope but is made private here. Neither can read the prefix cache, and nothing either writes
can ever be hit by anyone.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Final

from kvguard.isolation.scope import CacheConfig, ModelRef, Scope, Share, TokenizerRef

# Outside TENANT_ID_PATTERN (the "/"): no registered tenant, and no policy entry, can ever share it
# (found by a review: a tenant registered as "kvguard:ungoverned" took over every ungoverned
# request's tag, ledger view and policy).
UNGOVERNED_TENANT: Final = "kvguard/ungoverned"


def make_private(request: Any, *, skip_reading: bool = True) -> None:
    """No reads from the prefix cache, and no writes anyone could hit: the request's block hashes
    are recomputed under a one-off salt. Without this, a request carrying a copied salt would
    register blocks under the victim's hashes while it runs (the custody reuse check would then
    stop the engine on the victim's next hit: safe, but a denial of service)."""
    # `skip_reading` False only for a request kvguard may still hold in the waiting queue (quota):
    # vLLM schedules a skip-reading request whatever the connector says; its one-off salt alone
    # already guarantees that it can hit nothing.
    request.skip_reading_prefix_cache = skip_reading
    request.cache_salt = "kvguard-private:" + secrets.token_urlsafe(16)
    request.block_hashes = []
    request.update_block_hashes()


def ungoverned_scope(model_name: str, block_size: int, request_id: str) -> Scope:
    """A private, single-request scope: nothing of ungoverned traffic is shared or retained."""
    return Scope(
        tenant_id=UNGOVERNED_TENANT,
        share=Share.SESSION,
        session_id=request_id,
        model=ModelRef(id=model_name, revision="unknown"),
        tokenizer=TokenizerRef(id=model_name, revision="unknown"),
        cache_config=CacheConfig(kv_dtype="auto", block_size=block_size),
    )


def confine_hashes(request: Any, shared_blocks: int, key: bytes) -> None:
    """Only the request's first `shared_blocks` block hashes stay the group's: every later one is
    keyed with `key` (its tenant's own secret), so another member of the share group can never hit
    a block past the listed prefix, not even while the request runs (vLLM registers every full
    block's hash as it schedules it, and only what custody keeps cached is the group's). The chain
    goes on from the keyed hash, so all later blocks differ too; the same tenant's requests still
    match each other. A request without a block hasher (prefix caching off) hashes nothing."""
    hasher = getattr(request, "_block_hasher", None)
    if hasher is None:
        return

    def confined(req: Any) -> list[Any]:
        first = len(req.block_hashes)
        hashes = list(hasher(req))
        for i in range(max(0, shared_blocks - first), len(hashes)):
            hashes[i] = _keyed(key, hashes[i])
        return hashes

    request._block_hasher = confined
    request.block_hashes = []
    request.update_block_hashes()


def _keyed(key: bytes, block_hash: Any) -> bytes:
    """vLLM's block hashes are bytes (`BlockHash`); anything else is keyed by its repr."""
    raw = block_hash if isinstance(block_hash, bytes) else repr(block_hash).encode()
    return hashlib.sha256(key + raw).digest()
