"""`/v1/audit`: ledger queries, entries with inclusion proofs, checkpoints, consistency proofs, exports."""

from __future__ import annotations

from fastapi import APIRouter

from kvguard.api.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1/audit", tags=["audit"], responses=ERROR_RESPONSES)
