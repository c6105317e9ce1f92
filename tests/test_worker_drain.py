"""Graceful stop of a real worker process: SIGTERM drains, new requests get 503, the process exits 0.

The worker runs under tests/serve_with_step_gate.py, so the test decides when the engine steps:
requests stay in flight for as long as the test needs, however fast or slow the machine is.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_fixtures import metric_value

from vramledger.worker.http.settings import SHUTDOWN_MARGIN
from vramledger.worker.selfcheck.processes import wait_until


def events(lines):
    """The data fields of a server-sent event stream, one at a time."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]


def draining(url: str) -> bool:
    response = httpx.get(url + "/health")
    return response.status_code == 503 and response.json()["status"] == "draining"


def request(model: str, stream: bool, max_tokens: int = 12) -> dict:
    return {"model": model, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


def test_sigterm_lets_the_running_stream_finish_and_refuses_new_requests(gated_worker):
    proc, url, model = gated_worker("--drain-timeout", "120")
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", url + "/v1/completions", json=request(model, stream=True)) as stream:
        assert stream.status_code == 200
        client.post(url + "/test/steps", params={"n": 1})
        received = events(stream.iter_lines())
        first = json.loads(next(received))
        assert first["choices"][0]["token_ids"]  # the request is running: it has produced a token

        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: draining(url), 30, "/health to answer 503 draining", proc)
        refused = client.post(url + "/v1/completions", json=request(model, stream=False))
        assert refused.status_code == 503
        assert refused.headers["retry-after"].isdigit()
        assert refused.json()["error"]["code"] == "shutting_down"
        refused_chat = client.post(url + "/v1/chat/completions",
                                   json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert refused_chat.status_code == 503
        # The exporter and Prometheus still read a draining worker.
        assert client.get(url + "/v1/memory").status_code == 200
        assert proc.poll() is None  # still draining: the stream holds it

        client.post(url + "/test/steps", params={"n": -1})
        rest = [doc for doc in received]
    assert rest[-1] == "[DONE]"
    chunks = [first] + [json.loads(doc) for doc in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 12  # every token, none lost
    assert proc.wait(timeout=60) == 0


def test_requests_still_running_at_the_drain_timeout_are_aborted(gated_worker):
    proc, url, model = gated_worker("--drain-timeout", "1")
    results = {}

    def whole_response():
        results["plain"] = httpx.post(url + "/v1/completions", json=request(model, stream=False, max_tokens=64),
                                      timeout=60)

    streamed = {**request(model, stream=True, max_tokens=64), "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", url + "/v1/completions", json=streamed) as stream:
        client.post(url + "/test/steps", params={"n": 1})
        received = events(stream.iter_lines())
        first = json.loads(next(received))
        plain = threading.Thread(target=whole_response)
        plain.start()
        # The engine is held inside its next step: the second request waits for admission.
        wait_until(lambda: metric_value(client.get(url + "/metrics").text, "vramledger_requests_waiting") == 1,
                   30, "the second request to be queued", proc)
        proc.send_signal(signal.SIGTERM)  # and the engine never steps again: the drain times out
        terminated = time.monotonic()
        rest = [doc for doc in received]
    plain.join(timeout=60)
    assert rest[-1] == "[DONE]"
    chunks = [first] + [json.loads(doc) for doc in rest[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    delivered = sum(len(c["choices"][0]["token_ids"]) for c in chunks)
    assert 1 <= delivered < 64
    assert json.loads(rest[-2])["usage"]["completion_tokens"] == delivered  # usage counts what was sent
    assert results["plain"].status_code == 200
    assert results["plain"].json()["choices"][0]["finish_reason"] == "abort"
    # Within the grace period --help and docs/kubernetes.md give: the drain, then SHUTDOWN_MARGIN.
    assert proc.wait(timeout=max(0.1, terminated + 1 + SHUTDOWN_MARGIN - time.monotonic())) == 0


def test_sigterm_on_an_idle_worker_exits_0_at_once(gated_worker):
    proc, url, _ = gated_worker("--drain-timeout", "120")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0  # nothing in flight: far sooner than the 120 s drain timeout
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
