"""GET /v1/memory: the memory ledger as JSON (docs/ledger.md)."""
from __future__ import annotations

from fastapi import APIRouter

from vramledger.worker.http.errors import ERRORS
from vramledger.worker.http.state import StateDep

router = APIRouter()


@router.get("/v1/memory", responses=ERRORS)
async def memory(state: StateDep):
    """The memory ledger (docs/ledger.md), with live values measured now."""
    return state.engine_or_503().memory_report()
