"""The API contract both ways: every field the server accepts does something (and docs/api.md lists
exactly those), what it cannot honour is refused, and every error says what to do with a code."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from vramledger.worker.http.openai_protocol import chat_text
from vramledger.worker.http.request_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "llama-chat"
OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"], error  # every error says what happened, with a code
    return error


def test_the_api_doc_lists_exactly_the_fields_the_server_accepts():
    doc = (ROOT / "docs" / "api.md").read_text()
    start = doc.index("Request fields, each implemented")
    listed = doc[start:re.compile(r"never\s+silently ignored").search(doc, start).start()]
    names = {n for n in re.findall(r"`([^`]+)`", listed) if re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", n)}
    accepted = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    accepted.remove("stream_options")
    accepted |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    accepted |= set(ChatMessage.model_fields)  # each message's fields
    assert names == accepted


def test_stream_options_without_streaming_is_400(spec_server):
    response = httpx.post(spec_server.url + "/v1/completions",
                          json={**OK, "stream_options": {"include_usage": True}})
    assert error_of(response, 400)["param"] == "stream_options"
    streamed = httpx.post(spec_server.url + "/v1/completions",
                          json={**OK, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and '"usage"' in streamed.text


def test_a_message_name_the_template_leaves_out_is_400(spec_server):
    # The test servers' template (ChatML, as the shipped pair's) writes roles and contents only.
    named = {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "ada"}]}
    error = error_of(httpx.post(spec_server.url + "/v1/chat/completions", json=named), 400)
    assert error["param"] == "messages" and error["code"] == "unsupported_parameter"
    assert "name" in error["message"]


def test_a_message_name_reaches_a_template_that_uses_it(checkpoints):
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["llama"])
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}{% if m['name'] %}({{ m['name'] }})"
                               "{% endif %}: {{ m['content'] }}\n{% endfor %}")
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi", "name": "ada"}, {"role": "assistant", "content": "hello"}]})
    assert chat_text(body, tokenizer) == "user(ada): hi\nassistant: hello\n"


def test_user_is_accepted(spec_server):
    response = httpx.post(spec_server.url + "/v1/completions", json={**OK, "user": "user-1234"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_the_openai_sdk_retrieves_the_model(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.owned_by == "vramledger" and model.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.code == "model_not_found"


def test_every_error_has_a_code(spec_server, plain_server):
    url = spec_server.url
    assert error_of(httpx.get(url + "/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(httpx.get(url + "/v1/completions"), 405)["code"] == "method_not_allowed"
    assert error_of(httpx.post(url + "/v1/completions", content=b"{",
                               headers={"Content-Type": "application/json"}), 400)["code"] == "invalid_json"
    assert error_of(httpx.post(url + "/v1/completions", content=b"[]"), 400)["code"] == "invalid_body"
    assert error_of(httpx.post(url + "/v1/completions", json={**OK, "echo": True}), 400)["code"] \
        == "unsupported_parameter"
    assert error_of(httpx.post(url + "/v1/completions", json={**OK, "model": "gpt-9"}), 404)["code"] \
        == "model_not_found"
    assert error_of(httpx.post(url + "/v1/completions", content=b"x" * (8 << 20)), 413)["code"] \
        == "request_too_large"
    assert error_of(httpx.get(plain_server.url + "/v1/models"), 401)["code"] == "invalid_api_key"


def test_a_form_body_says_to_send_json(spec_server):
    # What plain `curl -d '{...}'` sends: the JSON text as application/x-www-form-urlencoded.
    response = httpx.post(spec_server.url + "/v1/completions", content=b'{"model": "llama-chat"}',
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    error = error_of(response, 415)
    assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]
    # Without any Content-Type the body is read as JSON.
    assert httpx.post(spec_server.url + "/v1/completions", content=b'{"model": "llama-chat", "prompt": "hi", '
                                                                   b'"max_tokens": 1}').status_code == 200


def test_the_openapi_schema_documents_the_parsed_bodies(plain_server):
    schema = httpx.get(plain_server.url + "/openapi.json").json()
    for path, name in (("/v1/completions", "CompletionRequest"),
                       ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert "min_p" in schema["components"]["schemas"][name]["properties"]
    assert {"ChatMessage", "TextPart", "StreamOptions"} <= set(schema["components"]["schemas"])
    assert "/v1/models/{model_id}" in schema["paths"]
