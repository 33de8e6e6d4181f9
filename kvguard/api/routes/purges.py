"""`/v1/purges`: purge jobs by session, tenant, model or adapter, their status and erasure certificates."""

from __future__ import annotations

from fastapi import APIRouter

from kvguard.api.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1/purges", tags=["purges"], responses=ERROR_RESPONSES)
