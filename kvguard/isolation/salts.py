"""Server-side salt derivation, scope tags and tenant tags.

salt = kid ":" base64url(HMAC-SHA256(key[kid], "kvguard/salt/v1" || encode_scope(scope)))

The client never chooses a salt (G1). The key id travels with the salt so keys can rotate: new salts use
the active key, and blocks salted under an older key simply stop matching. Bumping a scope's
`policy_epoch` changes its encoding and so every salt derived from it.

Scope tags and tenant tags are short public pseudonyms under their own HMAC labels, computed with the
pinned tag key: they stand in for scopes and tenants in logs, metrics and the ledger (G6) and reveal
nothing about the salt or the tenant id without the key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading
from typing import Final, NewType, TypeVar

from kvguard.errors import UntrustedSaltError
from kvguard.isolation.encoding import encode_tenant
from kvguard.isolation.keyring import Keyring
from kvguard.isolation.scope import Scope, Share

Salt = NewType("Salt", str)
ScopeTag = NewType("ScopeTag", str)
TenantTag = NewType("TenantTag", str)

_SALT_LABEL: Final = b"kvguard/salt/v1"
_SCOPE_TAG_LABEL: Final = b"kvguard/scope-tag/v1"
_MEMBER_TAG_LABEL: Final = b"kvguard/member-tag/v1"
_TENANT_TAG_LABEL: Final = b"kvguard/tenant-tag/v1"
_TAG_BYTES: Final = 12  # 96 bits: collision-free for any realistic number of scopes, short in logs.
_CACHE_MAX: Final = 65_536

_V = TypeVar("_V", bound=str)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


class SaltDeriver:
    """Derives salts and tags from a keyring, caching per scope (derivation is on every request path)."""

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring
        self._active = keyring.active
        self._salt_key = keyring.secret(keyring.active)
        self._tag_key = keyring.secret(keyring.tag_kid)
        # Keyed by the scope's domain key (its canonical encoding, computed once per scope): salts
        # and tags are functions of the reuse domain alone, and bytes hash faster than models.
        self._salts: dict[bytes, Salt] = {}
        self._tags: dict[bytes, ScopeTag] = {}
        self._member_tags: dict[bytes, ScopeTag] = {}
        self._lock = threading.Lock()

    @property
    def keyring(self) -> Keyring:
        return self._keyring

    def salt(self, scope: Scope) -> Salt:
        """The salt for `scope` under the active key."""
        key = scope.domain_key
        cached = self._salts.get(key)
        if cached is not None:
            return cached
        mac = hmac.new(self._salt_key, _SALT_LABEL + key, hashlib.sha256).digest()
        value = Salt(f"{self._active}:{_b64(mac)}")
        self._remember(self._salts, key, value)
        return value

    def scope_tag(self, scope: Scope) -> ScopeTag:
        """A short public pseudonym of `scope`'s reuse domain."""
        return self._tag(self._tags, _SCOPE_TAG_LABEL, scope.domain_key)

    def member_tag(self, scope: Scope) -> ScopeTag:
        """The tag of `scope` as its own tenant uses it: for tenant and session scopes, whose
        domain is one tenant's, the scope tag; for group and public scopes, whose domain several
        tenants share, a tag of the domain and the tenant together. What the engine records
        about a tenant's requests and blocks carries this tag, so each tag belongs to exactly one
        tenant: its audit level, its ledger view and its figures (a shared domain's scope tag
        named whichever member used it first, found by a review)."""
        if scope.share in (Share.TENANT, Share.SESSION):
            return self.scope_tag(scope)
        key = scope.domain_key + encode_tenant(scope.tenant_id)  # both self-delimiting
        return self._tag(self._member_tags, _MEMBER_TAG_LABEL, key)

    def _tag(self, table: dict[bytes, ScopeTag], label: bytes, key: bytes) -> ScopeTag:
        """`st_` + the HMAC of `label || key` under the tag key, cached in `table`."""
        cached = table.get(key)
        if cached is not None:
            return cached
        mac = hmac.new(self._tag_key, label + key, hashlib.sha256).digest()
        value = ScopeTag("st_" + _b64(mac[:_TAG_BYTES]))
        self._remember(table, key, value)
        return value

    def tenant_tag(self, tenant_id: str) -> TenantTag:
        """A short public pseudonym of a tenant, stable across salt-key rotation."""
        mac = hmac.new(self._tag_key, _TENANT_TAG_LABEL + encode_tenant(tenant_id), hashlib.sha256)
        return TenantTag("tt_" + _b64(mac.digest()[:_TAG_BYTES]))

    def check_not_client_salt(self, supplied: object) -> None:
        """Refuse any caller-supplied salt: salts are derived server-side only (G1)."""
        if supplied is not None:
            raise UntrustedSaltError(
                "a client-supplied cache_salt was refused: kvguard derives salts from the scope"
            )

    def _remember(self, table: dict[bytes, _V], key: bytes, value: _V) -> None:
        with self._lock:
            if len(table) >= _CACHE_MAX:
                table.clear()  # a full reset is cheap and keeps memory bounded; misses just recompute
            table[key] = value
