"""One request's choices (n of them, each its own engine sequence): collected whole or streamed as SSE."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vramledger.worker.http.engine_loop import EngineFailed
from vramledger.worker.http.errors import APIError, error_body
from vramledger.worker.http.renderer import ResponseRenderer, usage

if TYPE_CHECKING:
    from vramledger.worker.engine.outputs import RequestOutput, TokenLogprob
    from vramledger.worker.http.renderer import Choice


@dataclass
class Job:
    """One admitted request: its choices' engine ids and output queues, and how to render them."""

    request_id: str
    choice_ids: list[str]
    streams: list[asyncio.Queue]
    render: ResponseRenderer
    prompt_tokens: int


def sse(doc: dict) -> str:
    # ASCII only: U+0085, U+2028 and U+2029 are legal raw in JSON, but clients that split a stream
    # the way str.splitlines does (httpx's aiter_lines, so guidellm) would cut the document there.
    return f"data: {json.dumps(doc)}\n\n"


async def merged(streams: list[asyncio.Queue]) -> AsyncIterator[tuple[int, RequestOutput | EngineFailed]]:
    """(choice index, output) from every queue as they arrive, until each choice has finished."""
    if len(streams) == 1:  # the common case: no task per token
        while True:
            out = await streams[0].get()
            yield 0, out
            if isinstance(out, EngineFailed) or out.finished:
                return
    pending = {asyncio.ensure_future(q.get()): i for i, q in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                out = task.result()
                yield i, out
                if not (isinstance(out, EngineFailed) or out.finished):
                    pending[asyncio.ensure_future(streams[i].get())] = i
    finally:
        for task in pending:
            task.cancel()


async def collect(job: Job) -> list[Choice]:
    """Every choice run to its end: (text, token ids, finish reason, logprobs) per choice."""
    texts: list[list[str]] = [[] for _ in job.streams]
    token_ids: list[list[int]] = [[] for _ in job.streams]
    logprobs: list[list[TokenLogprob]] = [[] for _ in job.streams]
    reasons: list[str | None] = [None] * len(job.streams)
    async for i, out in merged(job.streams):
        if isinstance(out, EngineFailed):
            raise APIError(500, str(out), type="server_error", code="engine_failed")
        texts[i].append(out.text)
        token_ids[i].extend(out.new_token_ids)
        logprobs[i].extend(out.logprobs or [])
        reasons[i] = out.finish_reason
    wanted = job.render.num_logprobs is not None
    return [("".join(t), ids, r, lp if wanted else None) for t, ids, r, lp in zip(texts, token_ids, reasons, logprobs)]


async def events(job: Job, include_usage: bool, continuous_usage: bool,
                 abort: Callable[[str], None]) -> AsyncIterator[str]:
    """The SSE stream: a chunk per choice per step with new text (or tokens, when they are shown),
    usage in each chunk when asked (vLLM's continuous_usage_stats), usage at the end, [DONE].

    Chunks already queued behind the current one go out in the same write: a server that fell
    behind catches up in fewer, larger writes instead of one socket write per token.
    """
    completion = [0] * len(job.streams)
    finished = [False] * len(job.streams)
    show_tokens = job.render.return_token_ids or job.render.num_logprobs is not None
    ready: list[str] = []
    try:
        async for i, out in merged(job.streams):
            if isinstance(out, EngineFailed):
                yield "".join([*ready, sse(error_body(str(out), "server_error", None, "engine_failed"))])
                finished = [True] * len(finished)
                return
            finished[i], completion[i] = out.finished, out.num_output_tokens
            if out.text or out.finished or (show_tokens and out.new_token_ids):
                so_far = usage(job.prompt_tokens, sum(completion)) if continuous_usage else None
                ready.append(sse(job.render.chunk(out.text, out.new_token_ids, out.finish_reason, i, out.logprobs,
                                                  so_far)))
            if ready and not all(finished) and all(q.empty() for q in job.streams):
                yield "".join(ready)
                ready = []
        if include_usage:
            ready.append(sse(job.render.usage_chunk(job.prompt_tokens, sum(completion))))
        yield "".join([*ready, "data: [DONE]\n\n"])
    finally:
        for choice_id, done in zip(job.choice_ids, finished):
            if not done:
                abort(choice_id)
