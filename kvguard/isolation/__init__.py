"""Scopes and the secrets that keep them apart.

Owns: scopes, their canonical domain-separated encoding, HMAC salt derivation, the keyring and key
rotation, scope tags (public pseudonyms of scopes) and salted block-hash chains for engines with no salt
support. Never touches tensors and never decides policy.
"""

from kvguard.isolation.chain import BlockHash, chain_block_hash, chain_hashes
from kvguard.isolation.encoding import encode_scope, encode_tenant
from kvguard.isolation.keyring import KeyId, Keyring
from kvguard.isolation.salts import Salt, SaltDeriver, ScopeTag, TenantTag
from kvguard.isolation.scope import (
    AdapterRef,
    CacheConfig,
    GroupId,
    ModelRef,
    Scope,
    SessionId,
    Share,
    TenantId,
    TokenizerRef,
)

__all__ = [
    "AdapterRef",
    "BlockHash",
    "CacheConfig",
    "GroupId",
    "KeyId",
    "Keyring",
    "ModelRef",
    "Salt",
    "SaltDeriver",
    "Scope",
    "ScopeTag",
    "SessionId",
    "Share",
    "TenantId",
    "TenantTag",
    "TokenizerRef",
    "chain_block_hash",
    "chain_hashes",
    "encode_scope",
    "encode_tenant",
]
