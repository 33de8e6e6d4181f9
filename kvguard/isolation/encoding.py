"""Canonical, typed, length-prefixed encoding of a scope's reuse domain.

The encoding is what the salt HMAC and the scope tag are computed over, so it must be injective: two
different reuse domains never encode to the same bytes. vLLM issue 44701 is the failure it prevents:
key parts joined as untagged strings let a LoRA name collide with a salt. Here every field is written as

    field number (1 byte) || type (1 byte) || [length (4 bytes, big-endian) || value bytes]

in a fixed order after a magic and version header. Field numbers and types make the stream
self-delimiting, lengths make separators inside values (`"a|b"`, `"a\\x00b"`) harmless, and `None` has
its own type byte, so an absent adapter never equals an adapter named `""`.
"""

from __future__ import annotations

import struct
from typing import Final

from kvguard.isolation.scope import Scope, Share

_MAGIC: Final = b"KVGS"
_VERSION: Final = 1

_T_NONE: Final = 0x00
_T_STR: Final = 0x01
_T_INT: Final = 0x02

# Field numbers: append new ones, never renumber (a renumbering silently changes every salt).
_F_SHARE: Final = 1
_F_TENANT: Final = 2
_F_SESSION: Final = 3
_F_GROUP: Final = 4
_F_MODEL_ID: Final = 5
_F_MODEL_REV: Final = 6
_F_MODEL_DIGEST: Final = 7
_F_TOKENIZER_ID: Final = 8
_F_TOKENIZER_REV: Final = 9
_F_ADAPTER_ID: Final = 10
_F_ADAPTER_REV: Final = 11
_F_KV_DTYPE: Final = 12
_F_BLOCK_SIZE: Final = 13
_F_QUANT: Final = 14
_F_EPOCH: Final = 15

_LEN = struct.Struct(">I")
_I64 = struct.Struct(">q")


def _str(field: int, value: str | None, out: bytearray) -> None:
    if value is None:
        out += bytes((field, _T_NONE))
        return
    # surrogatepass keeps the map injective over every Python str, lone surrogates included.
    raw = value.encode("utf-8", "surrogatepass")
    out += bytes((field, _T_STR))
    out += _LEN.pack(len(raw))
    out += raw


def _int(field: int, value: int, out: bytearray) -> None:
    out += bytes((field, _T_INT))
    out += _I64.pack(value)


def encode_scope(scope: Scope) -> bytes:
    """Canonical bytes of `scope`'s reuse domain (see the module docstring for the layout).

    For share 'group' and 'public' the tenant (and session) are not part of the domain: that is what
    sharing means. For 'session' and 'tenant' they are. Computed once per (frozen) scope and kept on
    it (`Scope.domain_key`): the custody core compares domains on every allocation.
    """
    return scope.domain_key


def _encode(scope: Scope) -> bytes:
    """The encoding behind `encode_scope` (called by `Scope.domain_key`, once per scope)."""
    out = bytearray(_MAGIC)
    out.append(_VERSION)
    _str(_F_SHARE, scope.share.value, out)
    in_tenant = scope.share in (Share.SESSION, Share.TENANT)
    _str(_F_TENANT, scope.tenant_id if in_tenant else None, out)
    _str(_F_SESSION, scope.session_id if scope.share is Share.SESSION else None, out)
    _str(_F_GROUP, scope.group_id if scope.share is Share.GROUP else None, out)
    _str(_F_MODEL_ID, scope.model.id, out)
    _str(_F_MODEL_REV, scope.model.revision, out)
    _str(_F_MODEL_DIGEST, scope.model.weights_digest, out)
    _str(_F_TOKENIZER_ID, scope.tokenizer.id, out)
    _str(_F_TOKENIZER_REV, scope.tokenizer.revision, out)
    adapter = scope.adapter
    _str(_F_ADAPTER_ID, adapter.id if adapter else None, out)
    _str(_F_ADAPTER_REV, adapter.revision if adapter else None, out)
    _str(_F_KV_DTYPE, scope.cache_config.kv_dtype, out)
    _int(_F_BLOCK_SIZE, scope.cache_config.block_size, out)
    _str(_F_QUANT, scope.cache_config.quantization, out)
    _int(_F_EPOCH, scope.policy_epoch, out)
    return bytes(out)


def encode_tenant(tenant_id: str) -> bytes:
    """Canonical bytes of a bare tenant id (for tenant tags), distinct from any scope encoding."""
    out = bytearray(b"KVGT")
    out.append(_VERSION)
    _str(_F_TENANT, tenant_id, out)
    return bytes(out)
