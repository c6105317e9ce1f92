"""GET /v1/models: the one model this worker serves."""
from __future__ import annotations

from fastapi import APIRouter

from worker.http.errors import ERRORS
from worker.http.response_models import ModelList
from worker.http.state import StateDep

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(state: StateDep):
    """The one model this worker serves."""
    engine = state.engine_or_503()
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.started,
                                        "owned_by": "vramledger", "max_model_len": engine.config.max_model_len}]}
