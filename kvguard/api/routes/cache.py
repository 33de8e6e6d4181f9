"""`/v1/cache`: cache state per tenant and engine, from the engines' heartbeats, and `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter

from kvguard.api.errors import ERROR_RESPONSES

router = APIRouter(tags=["cache"], responses=ERROR_RESPONSES)
