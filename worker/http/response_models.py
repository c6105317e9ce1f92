"""The response documents as pydantic models, for the OpenAPI schema only (renderer.py builds them)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None  # abort: the worker stopped (drain timeout)
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A /v1/completions response; streamed chunks have the same shape without usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatTopLogprobSchema(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprobSchema(ChatTopLogprobSchema):
    top_logprobs: list[ChatTopLogprobSchema]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprobSchema]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None  # abort: the worker stopped (drain timeout)
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    """A /v1/chat/completions response; streamed chunks carry `delta` instead of `message`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vramledger"
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
