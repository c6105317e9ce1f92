"""The official openai client against the real server: completions and chat, whole and streamed."""
import httpx
import openai
import pytest
from server_fixtures import API_KEY

GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0)


def test_health_answered_503_while_loading_then_200(spec_server):
    assert 503 in spec_server.health_seen and spec_server.health_seen[-1] == 200
    assert httpx.get(spec_server.url + "/health").json() == {"status": "ok"}


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == "llama-chat" and model.owned_by == "vramledger"


def test_completion(client):
    out = client.completions.create(model="llama-chat", prompt="def f(x):", **GREEDY)
    (choice,) = out.choices
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.completion_tokens == 12 == len(choice.model_extra["token_ids"])
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_completion(client):
    out = client.chat.completions.create(model="llama-chat", messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], **GREEDY)
    (choice,) = out.choices
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12
    # the ChatML template wraps both messages and opens the assistant's turn
    assert out.usage.prompt_tokens > len("be brief hello")


def test_streamed_completion_matches_the_whole_one(client):
    whole = client.completions.create(model="llama-chat", prompt="hello world", **GREEDY)
    chunks = list(client.completions.create(model="llama-chat", prompt="hello world", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [t for c in text_chunks for t in c.choices[0].model_extra["token_ids"]] == \
        whole.choices[0].model_extra["token_ids"]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_completion(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="llama-chat", messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model="llama-chat", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    *deltas, usage_chunk = chunks
    assert deltas[0].choices[0].delta.role == "assistant" and deltas[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == "length"
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == 12


def test_seeded_sampling_is_reproducible(client):
    params = {"model": "llama-chat", "prompt": "the quick", "max_tokens": 10, "temperature": 0.8,
              "top_p": 0.9, "seed": 1234, "extra_body": {"ignore_eos": True, "top_k": 40}}
    assert client.completions.create(**params).choices[0].text == \
        client.completions.create(**params).choices[0].text


def test_stop_string_ends_the_completion(client):
    text = client.completions.create(model="llama-chat", prompt="hello", **GREEDY).choices[0].text
    stop = text[3:6]
    out = client.completions.create(model="llama-chat", prompt="hello", stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop" and stop not in out.choices[0].text
    assert text.startswith(out.choices[0].text)


def test_api_key_is_required_and_accepted(plain_server):
    good = openai.OpenAI(base_url=plain_server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model="llama-chat", prompt="hi", max_tokens=2).usage.completion_tokens <= 2
    bad = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
