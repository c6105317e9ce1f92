"""vLLM clients' request fields through the official openai client: each one changes what comes back."""
import openai
import pytest
from server_fixtures import API_KEY

MODEL = "llama-chat"
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 12}


def ids(extra=None, **kw):
    return {"extra_body": {"ignore_eos": True, "return_token_ids": True, **(extra or {})}, **kw}


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain_client(plain_server):  # the same target without a draft (and a 64-token context)
    return openai.OpenAI(base_url=plain_server.url + "/v1", api_key=API_KEY, max_retries=0)


def token_ids(choice):
    return choice.model_extra["token_ids"]


def test_continuous_usage_stats_puts_the_usage_in_every_chunk(client):
    chunks = list(client.completions.create(prompt="hello", stream=True, **GREEDY, **ids(), stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    *text_chunks, last = chunks
    assert text_chunks and all(c.usage is not None for c in text_chunks)
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert counts == sorted(counts) and counts[-1] == 12 == last.usage.completion_tokens
    # each chunk's count is the tokens out so far
    assert counts == [sum(len(token_ids(c.choices[0])) for c in text_chunks[:i + 1]) for i in range(len(counts))]
    assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in text_chunks)
    plain = list(client.completions.create(prompt="hello", stream=True, **GREEDY, **ids(),
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])  # without the option only the last chunk has it


def test_stop_token_ids_end_the_choice_and_min_tokens_holds_them_back(client):
    whole = token_ids(client.completions.create(prompt="abc", **GREEDY, **ids()).choices[0])
    stop = whole[3]
    out = client.completions.create(prompt="abc", **GREEDY, **ids({"stop_token_ids": [stop]}))
    assert out.choices[0].finish_reason == "stop" and token_ids(out.choices[0]) == whole[:whole.index(stop) + 1]
    held = client.completions.create(prompt="abc", **GREEDY, **ids({"stop_token_ids": [stop], "min_tokens": 8}))
    held_ids = token_ids(held.choices[0])
    assert stop not in held_ids[:8] and len(held_ids) > 8


def test_penalties_change_greedy_text_the_same_way_with_and_without_the_draft(client, plain_client):
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    body = {"prompt": "def f(x):", **GREEDY}
    unpenalised = token_ids(client.completions.create(**body, **ids()).choices[0])
    with_draft = token_ids(client.completions.create(**body, **penalties, **ids({"repetition_penalty": 1.8})).choices[0])
    without = token_ids(plain_client.completions.create(**body, **penalties,
                                                        **ids({"repetition_penalty": 1.8})).choices[0])
    assert with_draft == without != unpenalised
    assert all(a != b for a, b in zip(with_draft, with_draft[1:]))  # the repetition penalty at work


def test_min_p_one_keeps_only_the_most_likely_token_with_and_without_the_draft(client, plain_client):
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 12, "temperature": 1.5, "seed": 3}
    greedy = token_ids(client.completions.create(**{**body, "temperature": 0}, **ids()).choices[0])
    sampled = token_ids(client.completions.create(**body, **ids()).choices[0])
    assert sampled != greedy  # at this temperature the draws leave the greedy path
    for c in (client, plain_client):  # the draft proposes under min_p too
        assert token_ids(c.completions.create(**body, **ids({"min_p": 1.0})).choices[0]) == greedy


def test_completion_logprobs_whole_and_streamed(client, plain_client):
    out = client.completions.create(prompt="hello", logprobs=2, **GREEDY, **ids())
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens).startswith(out.choices[0].text[:1]) and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3 and token in top
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy chose the most likely token
    # the target's distribution: the same numbers without the draft
    plain = plain_client.completions.create(prompt="hello", logprobs=2, **GREEDY, **ids()).choices[0].logprobs
    assert plain.tokens == lp.tokens and plain.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
    streamed = list(client.completions.create(prompt="hello", logprobs=2, stream=True, **GREEDY, **ids()))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert client.completions.create(prompt="hello", **GREEDY).choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs_whole_and_streamed(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3, **GREEDY}
    out = client.chat.completions.create(**body, **ids())
    content = out.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    chunks = list(client.chat.completions.create(**body, stream=True, **ids()))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    only_chosen = client.chat.completions.create(**{**body, "top_logprobs": None}, **ids())
    assert all(e.top_logprobs == [] for e in only_chosen.choices[0].logprobs.content)
    assert client.chat.completions.create(**{**body, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_n_choices_each_sampled_on_its_own(client):
    body = {"model": MODEL, "prompt": "the", "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 3, **ids()}
    out = client.completions.create(**body)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({tuple(token_ids(c)) for c in out.choices}) > 1  # not one sample repeated
    assert out.usage.completion_tokens == 30 and out.usage.prompt_tokens > 0
    again = client.completions.create(**body)  # seeded: each choice reproducible
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    for i, choice in enumerate(out.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 30
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, **ids())
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
