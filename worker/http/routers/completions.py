"""POST /v1/completions: a prompt (text or token ids) completed, whole or streamed."""
from __future__ import annotations

from fastapi import APIRouter, Request

from vramledger.worker.http.errors import ERRORS
from vramledger.worker.http.generation import admit, prepare, respond
from vramledger.worker.http.request_body import documented
from vramledger.worker.http.request_models import CompletionRequest
from vramledger.worker.http.response_models import CompletionResponse
from vramledger.worker.http.state import StateDep

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS,
             openapi_extra=documented(CompletionRequest))
async def completions(request: Request, state: StateDep):
    """Complete a prompt (text or token ids); `"stream": true` answers with server-sent events."""
    body, token_ids = await prepare(state, request, CompletionRequest)
    return await respond(state.engine_loop, request, body, admit(state, body, token_ids, chat=False, param="prompt"))
