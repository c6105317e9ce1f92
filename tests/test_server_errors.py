"""Bad input and overload: each gets its status and an OpenAI-style error body, never a 500."""
import json
import threading
import time

import httpx
import pytest
from server_fixtures import API_KEY, metric_value

OK = {"model": "llama-chat", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "llama-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def check_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize("body, param, code", [
    ({**OK, "max_tokens": "5"}, "max_tokens", "invalid_value"),  # wrong type (no coercion)
    ({**OK, "stream": "yes"}, "stream", "invalid_value"),
    ({**OK, "prompt": 5}, "prompt", "invalid_value"),
    ({**OK, "echo": True}, "echo", "unsupported_parameter"),  # unknown field: not silently ignored
    ({**OK, "logprobs": 21}, "logprobs", "invalid_value"),
    ({**OK, "min_tokens": 3}, "min_tokens", "invalid_value"),  # more than max_tokens
    ({**OK, "stop_token_ids": [10**6]}, "stop_token_ids", "invalid_value"),  # outside the vocabulary
    ({**OK, "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({**OK, "frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
    ({**OK, "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({**OK, "stream_options": {"include_usage": True, "other": 1}}, "stream_options", "unsupported_parameter"),
    ({**OK, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({**OK, "max_tokens": -3}, "max_tokens", "invalid_value"),
    ({**OK, "max_tokens": 10**6}, "max_tokens", "context_length_exceeded"),  # above max_model_len
    ({**OK, "temperature": -0.5}, "temperature", "invalid_value"),
    ({**OK, "top_p": 0}, "top_p", "invalid_value"),
    ({**OK, "n": 0}, "n", "invalid_value"),
    ({**OK, "n": 1000}, "n", "invalid_value"),
    ({**OK, "stop": [""]}, "stop", "invalid_value"),
    ({**OK, "seed": 2**70}, "seed", "invalid_value"),
    ({**OK, "top_k": 2**40}, "top_k", "invalid_value"),  # would overflow the sampler's int64 tensor
    ({**OK, "prompt": ""}, "prompt", "empty_prompt"),
    ({**OK, "prompt": []}, "prompt", "empty_prompt"),
    ({**OK, "prompt": [1, 10**6]}, "prompt", "invalid_value"),  # token id outside the vocabulary
    ({**OK, "prompt": ["a", "b"]}, "prompt", "invalid_value"),  # batches are not supported
    ({**OK, "prompt": "hello " * 600}, "prompt", "context_length_exceeded"),  # longer than max_model_len
    ({k: v for k, v in OK.items() if k != "model"}, "model", "missing_parameter"),
])
def test_bad_completion_request_is_400(spec_server, body, param, code):
    check_error(httpx.post(spec_server.url + "/v1/completions", json=body), 400, param, code)


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages"),
    ({**CHAT, "tools": []}, "tools"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({**CHAT, "logprobs": 2}, "logprobs"),  # a boolean in chat
    ({**CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),
])
def test_bad_chat_request_is_400(spec_server, body, param):
    check_error(httpx.post(spec_server.url + "/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{not json", b'{"model": "llama-chat", "prompt": "x", "temperature": NaN}',
                                 b'{"model": "llama-chat", "prompt": "x", "temperature": Infinity}',
                                 b"[1, 2]", b'"text"', b"", b"[" * 40_000 + b"]" * 40_000,
                                 b'{"model": "llama-chat", "prompt": "\xff\xfe"}'])
def test_invalid_json_or_non_finite_numbers_are_400(spec_server, raw):
    response = httpx.post(spec_server.url + "/v1/completions", content=raw,
                          headers={"Content-Type": "application/json"})
    check_error(response, 400)


def test_unknown_model_is_404(spec_server):
    check_error(httpx.post(spec_server.url + "/v1/completions", json={**OK, "model": "gpt-9"}), 404, "model",
                "model_not_found")
    check_error(httpx.post(spec_server.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404,
                "model")


def test_unknown_route_and_method_have_error_bodies(spec_server):
    check_error(httpx.get(spec_server.url + "/v1/nothing"), 404)
    check_error(httpx.get(spec_server.url + "/v1/completions"), 405)


def test_body_over_the_limit_is_413(spec_server):
    big = json.dumps({**OK, "prompt": "x" * (5 << 20)}).encode()  # the limit is 4 MiB
    check_error(httpx.post(spec_server.url + "/v1/completions", content=big,
                           headers={"Content-Type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(5):
            yield b" " * (1 << 20)

    response = httpx.post(spec_server.url + "/v1/completions", content=chunks(),
                          headers={"Content-Type": "application/json"})
    check_error(response, 413)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_v1_needs_the_bearer_key(plain_server, headers):
    for path in ("/v1/models", "/v1/memory"):
        response = httpx.get(plain_server.url + path, headers=headers)
        assert response.headers["www-authenticate"] == "Bearer"
        assert check_error(response, 401)["code"] == "invalid_api_key"
    # refused before the body is read: bad JSON from a stranger is still a 401
    assert httpx.post(plain_server.url + "/v1/completions", content=b"{", headers=headers).status_code == 401


def test_health_and_metrics_stay_open_with_an_api_key(plain_server):
    assert httpx.get(plain_server.url + "/health").status_code == 200
    assert httpx.get(plain_server.url + "/metrics").status_code == 200
    assert httpx.get(plain_server.url + "/v1/models", headers=AUTH).status_code == 200


def test_full_waiting_queue_is_503_with_retry_after(gated_worker):
    # One running request and one waiting slot. The engine steps only as the test allows
    # (serve_with_step_gate.py): on a fast machine the running request would finish first.
    _, url, model = gated_worker("--max-num-seqs", "1", "--max-waiting", "1", "--max-model-len", "64")
    long = {"model": model, "prompt": "hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=long):
        client.post(url + "/test/steps", params={"n": 1})  # its prefill: it runs
        deadline = time.monotonic() + 60
        while metric_value(client.get(url + "/metrics").text, "vramledger_requests_running") != 1:
            assert time.monotonic() < deadline, "the first request never ran"
            time.sleep(0.05)
        with client.stream("POST", url + "/v1/completions", json=long) as second:
            assert second.status_code == 200  # it waits for the running request
            refused = client.post(url + "/v1/completions", json={**long, "stream": False})
            error = check_error(refused, 503, code="queue_full")
            assert refused.headers["retry-after"] == "1" and "overloaded" in error["message"]
            client.post(url + "/test/steps", params={"n": -1})


def test_concurrent_bad_requests_leave_the_server_healthy(spec_server):
    statuses = []

    def send(body):
        statuses.append(httpx.post(spec_server.url + "/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=send, args=({**OK, "max_tokens": -i},)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [400] * 8 and httpx.get(spec_server.url + "/health").status_code == 200


def test_more_choices_than_the_queue_holds_is_400(plain_server):
    # plain: one waiting slot, so two choices could never be admitted together
    response = httpx.post(plain_server.url + "/v1/completions", json={**OK, "n": 2}, headers=AUTH)
    check_error(response, 400, "n", "invalid_value")
