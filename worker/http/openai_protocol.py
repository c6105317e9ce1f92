"""OpenAI requests to engine inputs: token ids, sampling settings, and 400s for what does not fit."""
from __future__ import annotations

import dataclasses
from typing import cast

from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.http.errors import APIError
from vramledger.worker.http.request_models import ChatCompletionRequest, CompletionRequest


def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """A completion prompt (text or token ids, alone or in a list of one): 400 for a batch or nothing."""
    one = prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported; send one request per prompt",
                           param="prompt", code="invalid_value")
        one = prompt[0]
    if not one:
        raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    return cast("str | list[int]", one)  # a string, or the token ids the request model allows


def check_fits(prompt_tokens: int, max_model_len: int, param: str) -> None:
    """The engine needs the prompt plus at least one new token to fit in max_model_len."""
    if prompt_tokens > max_model_len - 1:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; max_model_len is {max_model_len}, "
                       f"so at most {max_model_len - 1} prompt tokens fit", param=param,
                       code="context_length_exceeded")


def checked_token_ids(token_ids: list[int], vocab_size: int, max_model_len: int) -> list[int]:
    """A token-id prompt that fits and indexes the vocabulary."""
    check_fits(len(token_ids), max_model_len, "prompt")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt",
                       code="invalid_value")
    return list(token_ids)


def text_token_ids(text: str, tokenizer, chat: bool) -> list[int]:
    """A text's token ids: a prompt's with the tokenizer's special tokens, a rendered conversation's
    without (its template wrote them)."""
    token_ids = tokenizer.encode(text, add_special_tokens=not chat)
    if not token_ids:
        raise APIError(400, f"the {'conversation' if chat else 'prompt'} is empty",
                       param="messages" if chat else "prompt", code="empty_prompt")
    return token_ids


def chat_text(body: ChatCompletionRequest, tokenizer) -> str:
    """The conversation through the tokenizer's chat template, opened for the assistant's turn; 400
    when a message has a `name` the template leaves out."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the model's tokenizer has no chat template; use /v1/completions",
                       param="messages", code="no_chat_template")
    messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                for m in body.messages]
    text = render(tokenizer, messages)
    if any("name" in m for m in messages) and text == render(tokenizer, [
            {k: v for k, v in m.items() if k != "name"} for m in messages]):
        raise APIError(400, "this model's chat template does not use message names; leave `name` out",
                       param="messages", code="unsupported_parameter")
    return text


def render(tokenizer, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template rejects the conversation (e.g. raise_exception)
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages",
                       code="invalid_value") from exc


def sampling_params(body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, max_model_len: int,
                    param: str, vocab_size: int | None = None) -> SamplingParams:
    """The engine's SamplingParams; the prompt and max_tokens must fit in max_model_len together."""
    check_fits(prompt_tokens, max_model_len, param)
    room = max_model_len - prompt_tokens
    chat = isinstance(body, ChatCompletionRequest)
    requested, name = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:  # the newer name
        if requested is not None and requested != body.max_completion_tokens:  # neither is guessed
            raise APIError(400, f"max_tokens={requested} and max_completion_tokens={body.max_completion_tokens} "
                           "disagree; send one of them (max_completion_tokens is the newer name)",
                           param="max_completion_tokens", code="conflicting_parameters")
        requested, name = body.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested = room if chat else min(16, room)
    if requested > room:
        raise APIError(400, f"{name}={requested} is too large: the prompt has {prompt_tokens} tokens and "
                       f"max_model_len is {max_model_len}, so at most {room} new tokens fit", param=name,
                       code="context_length_exceeded")
    if body.min_tokens > requested:
        raise APIError(400, f"min_tokens={body.min_tokens} is more than {name}={requested}", param="min_tokens",
                       code="invalid_value")
    stop_ids = body.stop_token_ids or []
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids",
                       code="invalid_value")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return SamplingParams(max_tokens=requested, temperature=body.effective_temperature, top_p=body.top_p,
                          top_k=max(0, body.top_k), min_p=body.min_p, seed=body.seed, stop=body.stop_list,
                          stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                          repetition_penalty=body.repetition_penalty, logprobs=body.num_logprobs)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice; a seeded request gives each choice its own seed (seed ^ index),
    so the choices differ and the whole answer is reproducible."""
    if params.seed is None or n == 1:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed ^ i) for i in range(n)]
