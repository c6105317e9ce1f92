"""OpenAI-compatible request bodies, error bodies and response documents (the subset served)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16
SEED_RANGE = {"ge": -(1 << 63), "le": (1 << 64) - 1}  # what torch.Generator.manual_seed takes
GREEDY_BELOW = 1e-5  # temperatures this small mean greedy; dividing logits by them overflows


class StrictModel(BaseModel):
    # Strict: "5" is not a number; forbid: a parameter we do not implement is an error, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    """`stream_options`: only include_usage (a last chunk with the usage) is supported."""

    include_usage: bool = False


class SamplingRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, description="default: 16 (completions), the rest of "
                                                           "the context (chat)")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=(1 << 31) - 1, description="0 or -1 disables")  # the sampler's int64
    seed: int | None = Field(None, **SEED_RANGE)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="only 1 is supported")
    user: str | None = None  # accepted for compatibility; never logged
    ignore_eos: bool = False  # vLLM extension: generate max_tokens tokens even past end-of-text
    return_token_ids: bool = False  # vLLM extension: each choice also carries its new token ids

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported; send one request per completion")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return stop

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def effective_temperature(self) -> float:
        return 0.0 if self.temperature < GREEDY_BELOW else self.temperature


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or token ids; a list of one of them is accepted too")


class TextPart(StrictModel):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat message; content is text or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")


# --- errors ----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


class APIError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI-style error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- responses (plain dicts: they are built once per chunk on the hot path) -------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseRenderer:
    """The id, object kind, creation time and model every response and chunk of a request carries."""

    def __init__(self, request_id: str, chat: bool, model: str, return_token_ids: bool):
        self.request_id, self.chat, self.model = request_id, chat, model
        self.return_token_ids = return_token_ids
        self.created = int(time.time())
        self._role_sent = False

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        """One server-sent event's document for new text."""
        if self.chat:
            delta = {"content": text}
            if not self._role_sent:
                delta, self._role_sent = {"role": "assistant", "content": text}, True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            doc = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            doc = self._head("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        doc["choices"] = [choice]
        return doc

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        doc = self._head("chat.completion.chunk" if self.chat else "text_completion")
        doc.update(choices=[], usage=usage(prompt_tokens, completion_tokens))
        return doc

    def response(self, text: str, token_ids: list[int], finish_reason: str | None,
                 prompt_tokens: int) -> dict:
        """The whole (non-streaming) response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            doc = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            doc = self._head("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        doc.update(choices=[choice], usage=usage(prompt_tokens, len(token_ids)))
        return doc


# --- response models, for the OpenAPI schema only -----------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
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


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
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
