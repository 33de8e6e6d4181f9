"""Scopes: the complete description of who may reuse a cached KV block.

A block computed under one scope may only serve a request under an identical *reuse domain* (G1). The
domain covers everything that changes the bytes of the cache or who may see them: the sharing unit
(session, tenant, share group or public), model (id, revision, optional weights digest), tokenizer,
adapter, cache configuration and the policy epoch. vLLM's own key leaves model identity out; so a model
swap behind the same name would otherwise serve stale KV (ARCHITECTURE.md, engine facts).

`tenant_id` is always present (it says who asks and who is charged), but it enters the domain only
when the sharing unit is the session or the tenant: sharing with a group or the public is exactly
dropping the tenant from the key. Whether a tenant may use a wider share is policy's decision.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from typing import Final, NewType, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

TenantId = NewType("TenantId", str)
# What a registered tenant's id may be (they travel in URL paths and file names: no slashes, no
# spaces, no control characters), and so what a policy document may name. kvguard's own pseudo
# tenants (ungoverned traffic) use a character outside it: no tenant can ever be registered, or
# given a policy, under their ids.
TENANT_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
SessionId = NewType("SessionId", str)
GroupId = NewType("GroupId", str)

ID_MAX = 256  # characters in a tenant, session or group id, a model id or a revision


class Share(StrEnum):
    """The unit inside which cached KV state may be reused."""

    SESSION = "session"
    TENANT = "tenant"
    GROUP = "group"
    PUBLIC = "public"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelRef(_Frozen):
    """The model whose weights produced the KV state."""

    id: str = Field(min_length=1, max_length=ID_MAX)
    revision: str = Field(min_length=1, max_length=ID_MAX)
    weights_digest: str | None = Field(default=None, max_length=ID_MAX)


class TokenizerRef(_Frozen):
    """The tokenizer that turned text into the token ids the blocks are keyed by."""

    id: str = Field(min_length=1, max_length=ID_MAX)
    revision: str = Field(min_length=1, max_length=ID_MAX)


class AdapterRef(_Frozen):
    """A LoRA (or similar) adapter active for the request."""

    id: str = Field(min_length=1, max_length=ID_MAX)
    revision: str = Field(min_length=1, max_length=ID_MAX)


class CacheConfig(_Frozen):
    """Cache settings that change the meaning of the stored bytes."""

    kv_dtype: str = Field(min_length=1, max_length=64)
    block_size: int = Field(gt=0, le=1 << 20)
    quantization: str | None = Field(default=None, max_length=64)


class Scope(_Frozen):
    """Who asks, and inside which reuse domain their KV state may be shared."""

    tenant_id: str = Field(min_length=1, max_length=ID_MAX)
    share: Share = Share.TENANT
    session_id: str | None = Field(default=None, min_length=1, max_length=ID_MAX)
    group_id: str | None = Field(default=None, min_length=1, max_length=ID_MAX)
    model: ModelRef
    tokenizer: TokenizerRef
    adapter: AdapterRef | None = None
    cache_config: CacheConfig
    policy_epoch: int = Field(default=0, ge=0, lt=1 << 63)

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="after")
    def _share_fields_match(self) -> Self:
        # One meaning, one encoding: a field that does not belong to the chosen share is refused rather
        # than silently ignored, so two scopes that differ only in an ignored field cannot exist.
        if self.share is Share.SESSION and self.session_id is None:
            raise ValueError("session_id is required when share is 'session'")
        if self.share is not Share.SESSION and self.session_id is not None:
            raise ValueError(
                f"session_id is only allowed when share is 'session' (share is '{self.share}')"
            )
        if self.share is Share.GROUP and self.group_id is None:
            raise ValueError("group_id is required when share is 'group'")
        if self.share is not Share.GROUP and self.group_id is not None:
            raise ValueError(
                f"group_id is only allowed when share is 'group' (share is '{self.share}')"
            )
        return self

    def with_share(
        self, share: Share, *, session_id: str | None = None, group_id: str | None = None
    ) -> Scope:
        """A copy of this scope under another sharing unit (validated)."""
        data = self.model_dump()
        data.update(share=share, session_id=session_id, group_id=group_id)
        return Scope.model_validate(data)

    @cached_property
    def domain_key(self) -> bytes:
        """The canonical encoding of the scope: equal exactly when the reuse domains are equal.
        Computed once per (immutable) scope: custody compares domains on every block it moves."""
        from kvguard.isolation.encoding import _encode  # noqa: PLC0415 (circular import)

        return _encode(self)

    def __eq__(self, other: object) -> bool:
        # Equal exactly when every field is: the domain key encodes all fields but the tenant (and
        # the validator ties session / group ids to the share), so (tenant, domain key) is the whole
        # scope. Pydantic's field-by-field comparison cost more than custody's own work per block.
        if not isinstance(other, Scope):
            return NotImplemented
        return self is other or (
            self.tenant_id == other.tenant_id and self.domain_key == other.domain_key
        )

    def __hash__(self) -> int:
        return hash((self.tenant_id, self.domain_key))

    def same_domain(self, other: Scope) -> bool:
        """True when blocks of one scope may serve the other (identical reuse domain)."""
        return self is other or self.domain_key == other.domain_key
