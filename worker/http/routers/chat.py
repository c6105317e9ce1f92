"""POST /v1/chat/completions: a conversation answered through the model's chat template."""
from __future__ import annotations

from fastapi import APIRouter, Request

from vramledger.worker.http.errors import ERRORS
from vramledger.worker.http.generation import admit, prepare, respond
from vramledger.worker.http.request_body import documented
from vramledger.worker.http.request_models import ChatCompletionRequest
from vramledger.worker.http.response_models import ChatCompletionResponse
from vramledger.worker.http.state import StateDep

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS,
             openapi_extra=documented(ChatCompletionRequest))
async def chat_completions(request: Request, state: StateDep):
    """Answer a conversation through the model's chat template; streams like /v1/completions."""
    body, token_ids = await prepare(state, request, ChatCompletionRequest)
    return await respond(state.engine_loop, request, body, admit(state, body, token_ids, chat=True, param="messages"))
