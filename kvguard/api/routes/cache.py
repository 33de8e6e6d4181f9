"""`/v1/cache`: cache state per tenant and engine, from the engines' heartbeats, and `/metrics`.

Per-request and per-tenant cache statistics are a cross-tenant oracle (a hit rate that moves when
another tenant sends a prompt reveals the prompt), so a tenant_admin sees only its own tenant's rows
and never engine-wide totals or metrics.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from kvguard.api.deps import GLOBAL_READERS, READERS, Access, require
from kvguard.api.errors import ERROR_RESPONSES
from kvguard.api.offload import OneHopRoute
from kvguard.control.engines import EngineInfo, TenantCacheStats
from kvguard.control.tenants import TENANT_ID_PATTERN

router = APIRouter(route_class=OneHopRoute, tags=["cache"], responses=ERROR_RESPONSES)


class TenantEngineState(BaseModel):
    engine_id: str
    engine_live: bool = Field(description="The engine's last heartbeat is recent")
    blocks_active: int
    blocks_cached: int
    blocks_quarantined: int
    prompt_tokens: int
    prefill_tokens_avoided: int = Field(description="Prompt tokens served from the prefix cache")
    hit_rate: float | None = Field(description="prefill_tokens_avoided / prompt_tokens")
    blocks_zeroized: int
    bytes_zeroized: int
    oldest_cached_block_age_s: float | None
    updated_at: float


class TenantCacheState(BaseModel):
    tenant_id: str
    engines: list[TenantEngineState]
    totals: TenantEngineState | None = Field(description="Summed over live and stopped engines")


class EngineState(BaseModel):
    engine_id: str
    model: str
    block_size: int
    num_blocks: int
    live: bool
    started_at: float
    last_seen: float
    stopped_at: float | None
    totals: dict[str, float]


def _state(row: TenantCacheStats, live: bool, now: float) -> TenantEngineState:
    return TenantEngineState(
        engine_id=row.engine_id,
        engine_live=live,
        blocks_active=row.blocks_active,
        blocks_cached=row.blocks_cached,
        blocks_quarantined=row.blocks_quarantined,
        prompt_tokens=row.prompt_tokens,
        prefill_tokens_avoided=row.prefix_hit_tokens,
        hit_rate=row.prefix_hit_tokens / row.prompt_tokens if row.prompt_tokens else None,
        blocks_zeroized=row.blocks_zeroized,
        bytes_zeroized=row.bytes_zeroized,
        oldest_cached_block_age_s=(
            max(0.0, now - row.oldest_cached_at) if row.oldest_cached_at is not None else None
        ),
        updated_at=row.updated_at,
    )


def _sum(tenant_id: str, states: list[TenantEngineState]) -> TenantEngineState | None:
    if not states:
        return None
    prompt = sum(s.prompt_tokens for s in states)
    avoided = sum(s.prefill_tokens_avoided for s in states)
    ages = [s.oldest_cached_block_age_s for s in states if s.oldest_cached_block_age_s is not None]
    return TenantEngineState(
        engine_id="*",
        engine_live=any(s.engine_live for s in states),
        blocks_active=sum(s.blocks_active for s in states),
        blocks_cached=sum(s.blocks_cached for s in states),
        blocks_quarantined=sum(s.blocks_quarantined for s in states),
        prompt_tokens=prompt,
        prefill_tokens_avoided=avoided,
        hit_rate=avoided / prompt if prompt else None,
        blocks_zeroized=sum(s.blocks_zeroized for s in states),
        bytes_zeroized=sum(s.bytes_zeroized for s in states),
        oldest_cached_block_age_s=max(ages) if ages else None,
        updated_at=max(s.updated_at for s in states),
    )


def _live_ids(access: Access, now: float) -> set[str]:
    services = access.services
    return {
        e.engine_id for e in services.engines.live_engines(now, services.config.engine_max_age_s)
    }


@router.get("/v1/cache/tenants", response_model=list[TenantCacheState])
def cache_state(
    access: Annotated[Access, require(*READERS)],
    tenant_id: Annotated[str | None, Query(pattern=TENANT_ID_PATTERN, max_length=128)] = None,
) -> list[TenantCacheState]:
    """Cache state per tenant and engine; a tenant_admin gets only its own tenant."""
    services, now = access.services, access.services.clock()
    wanted = access.one_tenant_or_all(tenant_id)
    live = _live_ids(access, now)
    by_tenant: dict[str, list[TenantEngineState]] = {}
    for row in services.engines.tenant_stats(wanted):
        by_tenant.setdefault(row.tenant_id, []).append(_state(row, row.engine_id in live, now))
    if wanted is not None and wanted not in by_tenant:
        # 404 for a tenant that does not exist, as every other route answers (it answered a
        # made-up row echoing whatever was sent, a pasted API key included; found by a review).
        services.tenants.get(wanted)
        by_tenant[wanted] = []
    return [
        TenantCacheState(tenant_id=t, engines=states, totals=_sum(t, states))
        for t, states in sorted(by_tenant.items())
    ]


@router.get("/v1/cache/engines", response_model=list[EngineState])
def engines(access: Annotated[Access, require(*GLOBAL_READERS)]) -> list[EngineState]:
    """Every engine that ever reported, with its totals (admin and auditor only)."""
    now, max_age = access.services.clock(), access.services.config.engine_max_age_s
    return [_engine_state(e, e.live(now, max_age)) for e in access.services.engines.engines()]


def _engine_state(info: EngineInfo, live: bool) -> EngineState:
    return EngineState(
        engine_id=info.engine_id,
        model=info.model,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        live=live,
        started_at=info.started_at,
        last_seen=info.last_seen,
        stopped_at=info.stopped_at,
        totals={k: float(v) for k, v in info.totals.items()},
    )


@router.get(
    "/metrics",
    tags=["metrics"],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}},
)
def metrics(access: Annotated[Access, require(*GLOBAL_READERS)]) -> Response:
    """Prometheus metrics (admin or auditor key as the scrape bearer token), labelled by engine id
    and `tt_` tenant tag, never by tenant id."""
    body = generate_latest(access.services.metrics)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
