"""Many concurrent streams, and greedy output that does not depend on the draft model."""
import asyncio
import json

import httpx
from server_fixtures import API_KEY, sse_events
from transformers import AutoTokenizer

CLIENTS = 32
TOKENS = 20


async def one_stream(client: httpx.AsyncClient, url: str, i: int, chat: bool) -> dict:
    """Run one streaming request; return its parsed events after checking the framing."""
    body = {"model": "llama-chat", "max_tokens": TOKENS, "temperature": 0.7, "seed": i, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}: " + "hello " * (i % 7)}]
    else:
        body["prompt"] = f"request {i}: " + "the quick brown fox " * (i % 5)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines()]
    *events, done = sse_events(lines)
    assert done == "[DONE]"
    return {"chat": chat, "docs": [json.loads(e) for e in events]}


def test_32_concurrent_streaming_clients(spec_server, checkpoints):
    async def run():
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one_stream(client, spec_server.url, i, chat=i % 2 == 1)
                                          for i in range(CLIENTS)))

    tokenizer = AutoTokenizer.from_pretrained(checkpoints["llama"])
    results = asyncio.run(run())
    assert len(results) == CLIENTS
    ids = set()
    for result in results:
        *chunks, usage_doc = result["docs"]
        assert usage_doc["choices"] == [] and usage_doc["usage"]["completion_tokens"] == TOKENS
        assert len({d["id"] for d in result["docs"]}) == 1  # one id per stream ...
        ids.add(usage_doc["id"])
        choices = [c["choices"][0] for c in chunks]
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
        token_ids = [t for c in choices for t in c["token_ids"]]
        assert len(token_ids) == usage_doc["usage"]["completion_tokens"]
        if result["chat"]:
            assert choices[0]["delta"]["role"] == "assistant"
            text = "".join(c["delta"].get("content", "") for c in choices)
        else:
            text = "".join(c["text"] for c in choices)
        assert text == tokenizer.decode(token_ids, skip_special_tokens=True)  # no text lost or repeated
    assert len(ids) == CLIENTS  # ... and no two streams share one


def test_greedy_text_is_the_same_with_and_without_the_draft(spec_server, plain_server):
    prompts = ["def f(x):", "hello world, the quick", "brown fox " * 3]  # the plain server holds 64 tokens
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        spec = httpx.post(spec_server.url + "/v1/completions", json={"model": "llama-chat", **body}, timeout=60)
        plain = httpx.post(plain_server.url + "/v1/completions", json={"model": "llama-chat", **body}, timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}"})
        assert spec.status_code == plain.status_code == 200
        spec_choice, plain_choice = spec.json()["choices"][0], plain.json()["choices"][0]
        assert spec_choice["token_ids"] == plain_choice["token_ids"] and len(spec_choice["token_ids"]) == 32
        assert spec_choice["text"] == plain_choice["text"]
