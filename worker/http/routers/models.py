"""GET /v1/models and GET /v1/models/{id}: the one model this worker serves."""
from __future__ import annotations

from fastapi import APIRouter

from vramledger.worker.http.errors import ERRORS
from vramledger.worker.http.response_models import ModelCard, ModelList
from vramledger.worker.http.state import ServerState, StateDep

router = APIRouter()


def card(state: ServerState) -> dict:
    engine = state.engine_or_503()
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "vramledger",
            "max_model_len": engine.config.max_model_len}


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(state: StateDep):
    """The one model this worker serves."""
    return {"object": "list", "data": [card(state)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
async def model(model_id: str, state: StateDep):
    """The served model, by its name or its path (as /v1/completions accepts it); 404 for any other."""
    found = card(state)
    state.check_model(model_id)
    return found
