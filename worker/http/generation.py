"""A generation request from admission to answer, shared by the completions and chat routers.

`prepare` reads, parses and tokenizes the request; `admit` checks it against the engine and the
queue and submits one engine sequence per choice; `respond` answers with the whole response, or
with server-sent events when it streams.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vramledger.worker.http.body_slots import release_body_slot
from vramledger.worker.http.choices import Job, collect, events
from vramledger.worker.http.engine_loop import EngineLoop
from vramledger.worker.http.errors import APIError
from vramledger.worker.http.openai_protocol import choice_params, sampling_params
from vramledger.worker.http.renderer import ResponseRenderer
from vramledger.worker.http.request_body import parse, read_json
from vramledger.worker.http.request_models import ChatCompletionRequest, CompletionRequest, SamplingRequest
from vramledger.worker.http.state import ServerState

log = logging.getLogger(__name__)


def check_queue(state: ServerState, n: int, tokenizing: int = 0) -> None:
    """400 when n choices could never be admitted; 503 when they do not fit in the queue now, beside
    the requests waiting for the engine and the `tokenizing` ones (each becomes at least one)."""
    max_waiting = state.settings.max_waiting
    if n > max_waiting:  # the client's to change
        raise APIError(400, f"n={n} is more than this worker queues ({max_waiting})",
                       param="n", code="invalid_value")
    if state.engine_loop.num_waiting() + tokenizing + n > max_waiting:
        raise APIError(503, f"the worker is overloaded ({max_waiting} requests waiting); "
                       "retry later", type="server_error", code="queue_full", headers={"Retry-After": "1"})


Generation = TypeVar("Generation", CompletionRequest, ChatCompletionRequest)


async def prepare(state: ServerState, request: Request, model: type[Generation]) -> tuple[Generation, list[int]]:
    """A generation request read, parsed and tokenized (a few at a time: the others wait holding
    only their bytes), once the queue has room for it; its texts are dropped then, as its token ids
    say the same."""
    raw = await read_json(request)
    async with state.encoder.stage(len(raw)):
        body = parse(raw, model)
        del raw
        release_body_slot(request.scope)  # the stage's parsed bodies are counted apart
        engine = state.engine_or_503()
        state.check_model(body.model)
        check_queue(state, body.n, tokenizing=state.encoder.pending)
        max_model_len = engine.config.max_model_len
        if isinstance(body, ChatCompletionRequest):
            token_ids = await state.encoder.chat(body, max_model_len)
        else:
            token_ids = await state.encoder.prompt(body.prompt, max_model_len)
    body.drop_texts()
    return body, token_ids


def admit(state: ServerState, body: CompletionRequest | ChatCompletionRequest, token_ids: list[int], chat: bool,
          param: str) -> Job:
    """Submit the request's n choices, or refuse it: 400 when it cannot fit, 503 when the queue is full."""
    engine = state.engine_or_503()
    engine_loop = state.engine_loop
    params = sampling_params(body, len(token_ids), engine.config.max_model_len, param, state.encoder.vocab_size)
    check_queue(state, body.n)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choice_ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
    arrival = time.monotonic()
    group = request_id if body.n > 1 else ""
    streams = [engine_loop.submit(choice_id, token_ids, p, arrival, group)  # n sequences, one prompt
               for choice_id, p in zip(choice_ids, choice_params(params, body.n))]
    render = ResponseRenderer(request_id, chat, state.model_name, body.return_token_ids, body.num_logprobs)
    return Job(request_id, choice_ids, streams, render, len(token_ids))


async def respond(engine_loop: EngineLoop, request: Request, body: SamplingRequest, job: Job) -> Response:
    """The answer to an admitted request; a client that leaves first gets its choices aborted (499)."""
    if body.stream:
        return EventStream(job, events(job, body.include_usage, body.continuous_usage, engine_loop.abort),
                           media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collecting = asyncio.ensure_future(collect(job))
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((collecting, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collecting.done():  # the client left (or we are cancelled): free its blocks
            collecting.cancel()
            abort(engine_loop, job)
    if not collecting.done() or collecting.cancelled():
        client_left(job)
        return Response(status_code=499)
    if collecting.exception() is not None:
        abort(engine_loop, job)  # one choice failed: the others stop too
    return JSONResponse(job.render.response(collecting.result(), job.prompt_tokens))


def client_left(job: Job) -> None:
    """One line for a client that went away before its answer: its own doing, no server error."""
    log.info("%s: the client went away before the answer; its request was aborted", job.request_id)


def abort(engine_loop: EngineLoop, job: Job) -> None:
    for choice_id in job.choice_ids:
        engine_loop.abort(choice_id)


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events that notice a client that left even while no token is due."""

    def __init__(self, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        ended = False  # a response that ended reads as a disconnect too

        async with anyio.create_task_group() as group:
            async def watch():
                await self.listen_for_disconnect(receive)
                if not ended:
                    client_left(self.job)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self.stream_response(send)
                ended = True
            except OSError:  # the client closed the connection while we wrote
                ended = True
                client_left(self.job)
            finally:
                await self.body_iterator.aclose()  # runs the stream's finally: the abort
                group.cancel_scope.cancel()
