"""A generation request from admission to answer, shared by the completions and chat routers.

`admit` checks the request against the engine and the queue and submits one engine sequence per
choice; `respond` answers with the whole response, or with server-sent events when it streams.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from worker.http.choices import Job, collect, events
from worker.http.engine_loop import EngineLoop
from worker.http.errors import APIError
from worker.http.openai_protocol import choice_params, sampling_params
from worker.http.renderer import ResponseRenderer
from worker.http.request_models import SamplingRequest
from worker.http.state import ServerState


def admit(state: ServerState, body: SamplingRequest, token_ids: list[int], chat: bool, param: str) -> Job:
    """Submit the request's n choices, or refuse it: 400 when it cannot fit, 503 when the queue is full."""
    engine = state.engine_or_503()
    max_waiting, engine_loop = state.settings.max_waiting, state.engine_loop
    params = sampling_params(body, len(token_ids), engine.config.max_model_len, chat, param,
                             state.encoder.vocab_size)
    if body.n > max_waiting:  # could never be admitted: the client's to change
        raise APIError(400, f"n={body.n} is more than this worker queues ({max_waiting})",
                       param="n", code="invalid_value")
    if engine_loop.num_waiting() + body.n > max_waiting:
        raise APIError(503, f"the worker is overloaded ({max_waiting} requests waiting); "
                       "retry later", type="server_error", code="queue_full", headers={"Retry-After": "1"})
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choice_ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
    arrival = time.monotonic()
    streams = [engine_loop.submit(choice_id, token_ids, p, arrival)  # n sequences, one prompt
               for choice_id, p in zip(choice_ids, choice_params(params, body.n))]
    render = ResponseRenderer(request_id, chat, state.model_name, body.return_token_ids, body.num_logprobs)
    return Job(request_id, choice_ids, streams, render, len(token_ids))


async def respond(engine_loop: EngineLoop, request: Request, body: SamplingRequest, job: Job) -> Response:
    """The answer to an admitted request; a client that leaves first gets its choices aborted (499)."""
    if body.stream:
        return EventStream(events(job, body.include_usage, body.continuous_usage, engine_loop.abort),
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
        return Response(status_code=499)
    if collecting.exception() is not None:
        abort(engine_loop, job)  # one choice failed: the others stop too
    return JSONResponse(job.render.response(collecting.result(), job.prompt_tokens))


def abort(engine_loop: EngineLoop, job: Job) -> None:
    for choice_id in job.choice_ids:
        engine_loop.abort(choice_id)


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events that notice a client that left even while no token is due."""

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as group:
            async def watch():
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client closed the connection while we wrote
            finally:
                await self.body_iterator.aclose()  # runs the stream's finally: the abort
                group.cancel_scope.cancel()
