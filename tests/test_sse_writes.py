"""The SSE stream writes what is queued at once: one write per catch-up, not one per token."""
from __future__ import annotations

import asyncio
import json

from vramledger.worker.engine.outputs import RequestOutput
from vramledger.worker.http.choices import Job, events
from vramledger.worker.http.renderer import ResponseRenderer


def output(text: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("c0", [n], text, finished, "length" if finished else None, 3, n, 0, 0)


def run_stream(queued: list[RequestOutput], later: list[RequestOutput]) -> list[str]:
    """The strings events() yields when `queued` wait before it starts and `later` arrive one by one."""
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for out in queued:
            queue.put_nowait(out)
        job = Job("cmpl-1", ["c0"], [queue], ResponseRenderer("cmpl-1", False, "m", False), 3)
        writes = []

        async def feed():
            for out in later:
                await asyncio.sleep(0.01)
                queue.put_nowait(out)
        feeder = asyncio.ensure_future(feed())
        async for text in events(job, include_usage=True, continuous_usage=False, abort=lambda _: None):
            writes.append(text)
        await feeder
        return writes
    return asyncio.run(main())


def texts(writes: list[str]) -> list[str]:
    docs = [json.loads(e[len("data: "):]) for w in writes for e in w.split("\n\n")
            if e.startswith("data: {")]
    return [d["choices"][0]["text"] for d in docs if d["choices"]]


def test_a_backlog_goes_out_in_one_write_in_order():
    writes = run_stream([output("a", 1), output("b", 2), output("c", 3)], [output("d", 4, finished=True)])
    assert len(writes) == 2  # the three queued chunks, then the last with usage and [DONE]
    assert texts(writes) == ["a", "b", "c", "d"]
    assert writes[-1].endswith("data: [DONE]\n\n") and '"usage"' in writes[-1]


def test_tokens_that_arrive_apart_are_written_apart():
    writes = run_stream([], [output("a", 1), output("b", 2), output("c", 3, finished=True)])
    assert len(writes) == 3
    assert texts(writes) == ["a", "b", "c"]


def test_no_document_is_cut_by_a_client_that_splits_lines_like_splitlines():
    # httpx's aiter_lines (guidellm's reader) breaks lines wherever str.splitlines does, which
    # includes characters a model can generate and JSON may carry raw: U+0085, U+2028, U+2029.
    breaks = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
    sent = [f"a{c}b" for c in breaks] + ["é€😀"]
    writes = run_stream([], [output(t, i + 1, finished=i == len(sent) - 1) for i, t in enumerate(sent)])
    lines = [line for line in "".join(writes).splitlines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    docs = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert [d["choices"][0]["text"] for d in docs if d["choices"]] == sent
