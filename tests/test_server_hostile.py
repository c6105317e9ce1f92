"""Hostile input against a real server: strings no tokenizer can encode, and prompts far too long.
Each is refused with a 4xx in the OpenAI shape, the connection it came on keeps serving, and what a
refused request allocated goes back: the ledger finds the process where it was."""
import gzip
import json
import random
import statistics
import threading
import time

import httpx
import pytest

from vramledger.worker.http.prompt_bounds import PromptBound
from vramledger.worker.models.loader import load_tokenizer

MODEL = "llama-chat"
JSON = {"Content-Type": "application/json"}
SLOT = "@@slot@@"  # where a raw JSON escape goes: json.dumps would write a lone surrogate as-is
SURROGATES = {"lone high": r"\ud800", "lone low": r"\udfff", "reversed pair": r"\udc00\ud800"}
# Every string a request carries, with the other fields of a valid request around it (one new token:
# an odd but valid string is served, and what it generates is not the point).
STRING_FIELDS = {
    "completion model": ("/v1/completions", {"model": SLOT, "prompt": "hi", "max_tokens": 1}),
    "prompt": ("/v1/completions", {"model": MODEL, "prompt": f"a{SLOT}b", "max_tokens": 1}),
    "prompt in a list": ("/v1/completions", {"model": MODEL, "prompt": [SLOT], "max_tokens": 1}),
    "stop string": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": SLOT}),
    "stop list": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": ["x", SLOT]}),
    "completion user": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": SLOT}),
    "chat model": ("/v1/chat/completions", {"model": SLOT, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}]}),
    "chat content": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": SLOT}]}),
    "chat text part": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": SLOT}]}]}),
    "chat name": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi", "name": SLOT}]}),
    "chat role": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": SLOT, "content": "hi"}]}),
    "chat stop": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}], "stop": [SLOT]}),
}
# Strings JSON can carry that are valid Unicode: served or refused, never a server error.
ODD_BUT_VALID = [r"\u0000", r"\uffff", r"\ufffe", r"\ud83d\ude00", r"\udbff\udfff", "\\u202e", r"\u0301"]


def raw_body(body: dict, escape: str) -> bytes:
    return json.dumps(body).replace(SLOT, escape).encode()


def check_4xx(response: httpx.Response, status: int | None = None) -> dict:
    expected = 400 <= response.status_code < 500 if status is None else response.status_code == status
    assert expected, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error" and error["code"], error
    return error


@pytest.mark.parametrize("field", STRING_FIELDS)
def test_surrogates_in_every_string_field_are_400_and_the_connection_keeps_serving(spec_server, field):
    path, body = STRING_FIELDS[field]
    # One connection: a request that broke it would fail the next one on it.
    with httpx.Client(base_url=spec_server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        for escape in SURROGATES.values():
            refused = client.post(path, content=raw_body(body, escape), headers=JSON)
            assert check_4xx(refused, 400)["code"] == "invalid_json"
            assert refused.headers.get("connection") != "close"
            assert client.get("/v1/models").status_code == 200
        for escape in ODD_BUT_VALID:
            response = client.post(path, content=raw_body(body, escape), headers=JSON)
            assert response.status_code < 500, (escape, response.text)
            assert client.get("/v1/models").status_code == 200


def live(url: str) -> dict:
    return httpx.get(url + "/v1/memory").json()["live"]


def small_request_time(client: httpx.Client) -> float:
    """A short prompt and a few new tokens: long enough that the time it takes is its own work, not
    the microseconds of one more request's parsing."""
    started = time.monotonic()
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 16,
                                                     "ignore_eos": True})
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def oversized_bodies(spec_server, tokenizer_dir: str) -> list[tuple[bytes, int]]:
    """(body, status) of 50 prompts too long for the context, of each kind the server refuses: past the
    body limit (413 before reading), past the length bound (400 before tokenizing), and just under the
    bound with too many tokens (400 after tokenizing, one token per byte)."""
    max_model_len = httpx.get(spec_server.url + "/v1/models").json()["data"][0]["max_model_len"]
    most = PromptBound.of(load_tokenizer(tokenizer_dir)).max_units(max_model_len)  # bytes
    rng = random.Random(0)
    huge = "".join(rng.choice("abcdefgh ij\n") for _ in range(3_900_000))  # as a client pasting a file

    def body(prompt: str) -> bytes:
        return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()

    past_bound = body(" " * (most + 1))
    many_tokens = body("".join(chr(rng.randrange(0xF0000, 0x10FFFE)) for _ in range(most // 4)))
    return [(body(huge), 413)] * 20 + [(past_bound, 400)] * 15 + [(many_tokens, 400)] * 15


def test_50_refused_oversized_prompts_leave_the_ledger_as_it_was_and_delay_no_one(spec_server, checkpoints):
    bodies = oversized_bodies(spec_server, checkpoints["llama"])
    refusals: list[tuple[int, str]] = []
    senders = [httpx.Client(base_url=spec_server.url, timeout=120) for _ in range(2)]

    def refuse(sender: httpx.Client, raw: bytes, status: int, go: threading.Barrier):
        go.wait()
        response = sender.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        refusals.append((response.status_code, check_4xx(response, status)["code"]))

    with httpx.Client(base_url=spec_server.url, timeout=60) as client:
        for sender in senders:  # connected before the rounds: each round's requests start at once
            assert sender.get("/health").status_code == 200
        small_request_time(client)
        before = live(spec_server.url)
        ratios = []
        # Two oversized prompts at a time, a small request sent with them; the unloaded time is
        # measured just before and after, whatever else this machine does meanwhile.
        for pair in (bodies[i:i + 2] for i in range(0, len(bodies), 2)):
            unloaded = small_request_time(client)
            go = threading.Barrier(len(pair) + 1)
            threads = [threading.Thread(target=refuse, args=(sender, raw, status, go))
                       for sender, (raw, status) in zip(senders, pair)]
            for thread in threads:
                thread.start()
            go.wait()
            loaded = small_request_time(client)
            for thread in threads:
                thread.join()
            ratios.append(loaded / ((unloaded + small_request_time(client)) / 2))
        after = live(spec_server.url)
    for sender in senders:
        sender.close()
    assert len(refusals) == 50
    assert sorted(set(refusals)) == [(400, "context_length_exceeded"), (413, "request_too_large")]
    # The ledger's `unaccounted` is process - declared (floored at 0): the process is where it was.
    assert after["declared_bytes"] == before["declared_bytes"]
    assert after["process_bytes"] - before["process_bytes"] < 8 << 20, (before, after)
    assert after["unaccounted_bytes"] <= before["unaccounted_bytes"] + (8 << 20)
    assert statistics.median(ratios) < 2, sorted(ratios)


# Bodies that could be read two ways: each refused naming the problem, never served with a guess.
REPEATED_KEYS = {
    "top level": ("/v1/completions", b'{"model": "llama-chat", "prompt": "hi", "max_tokens": 1, '
                                     b'"max_tokens": 40, "ignore_eos": true}', "max_tokens"),
    "in a message": ("/v1/chat/completions", b'{"model": "llama-chat", "max_tokens": 1, "messages": '
                                             b'[{"role": "user", "content": "hi", "content": "bye"}]}', "content"),
    "in stream_options": ("/v1/completions", b'{"model": "llama-chat", "prompt": "hi", "max_tokens": 1, "stream": '
                                             b'true, "stream_options": {"include_usage": true, '
                                             b'"include_usage": false}}', "include_usage"),
    "in an unsupported field": ("/v1/completions", b'{"model": "llama-chat", "prompt": "hi", "max_tokens": 1, '
                                                   b'"logit_bias": {"5": 1, "5": -100}}', "5"),
}


@pytest.mark.parametrize("where", REPEATED_KEYS)
def test_a_key_repeated_in_any_object_is_400_naming_it(spec_server, where):
    path, raw, key = REPEATED_KEYS[where]
    error = check_4xx(httpx.post(spec_server.url + path, content=raw, headers=JSON, timeout=60), 400)
    assert error["code"] == "duplicate_key" and repr(key) in error["message"], error


def test_max_tokens_and_max_completion_tokens_that_disagree_are_400(spec_server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    refused = httpx.post(spec_server.url + "/v1/chat/completions", timeout=60,
                         json={**chat, "max_tokens": 1, "max_completion_tokens": 5})
    error = check_4xx(refused, 400)
    assert error["code"] == "conflicting_parameters" and "max_tokens=1" in error["message"], error
    agreeing = httpx.post(spec_server.url + "/v1/chat/completions", timeout=60,
                          json={**chat, "max_tokens": 3, "max_completion_tokens": 3})
    assert agreeing.status_code == 200 and agreeing.json()["usage"]["completion_tokens"] == 3, agreeing.text


@pytest.mark.parametrize("encoding", ["br", "gzip", "identity, gzip"])
def test_a_body_in_a_content_encoding_the_server_does_not_decode_is_415(spec_server, encoding):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    raw = gzip.compress(body) if "gzip" in encoding else body  # br: plain JSON that says it is not
    refused = httpx.post(spec_server.url + "/v1/completions", content=raw, timeout=60,
                         headers={**JSON, "Content-Encoding": encoding})
    error = check_4xx(refused, 415)
    assert error["code"] == "unsupported_content_encoding" and encoding in error["message"], error
    plain = httpx.post(spec_server.url + "/v1/completions", content=body, timeout=60,
                       headers={**JSON, "Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.text
