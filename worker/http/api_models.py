"""OpenAI-compatible request bodies, error bodies and response documents (the subset served)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice is a sequence of its own in the engine
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
SEED_RANGE = {"ge": -(1 << 63), "le": (1 << 64) - 1}  # what torch.Generator.manual_seed takes
GREEDY_BELOW = 1e-5  # temperatures this small mean greedy; dividing logits by them overflows


class StrictModel(BaseModel):
    # Strict: "5" is not a number; forbid: a parameter we do not implement is an error, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    """`stream_options`: a last chunk with the usage, and (vLLM's extension) the usage in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each sampled on its own")
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    user: str | None = None  # accepted for compatibility; never logged
    # vLLM extensions
    ignore_eos: bool = False  # generate max_tokens tokens even past end-of-text
    return_token_ids: bool = False  # each choice also carries its new token ids
    min_tokens: int = Field(0, ge=0, description="end-of-text and stops wait until this many tokens")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100, allow_inf_nan=False,
                                      description="> 1 discourages tokens of the prompt and the output")

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
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives each token's logprobs list; None when logprobs are not asked for."""
        return None

    @property
    def effective_temperature(self) -> float:
        return 0.0 if self.temperature < GREEDY_BELOW else self.temperature


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or token ids; a list of one of them is accepted too")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="the chosen token's logprob and this many most likely ones")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


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
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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


LOGPROB_FLOOR = -9999.0  # JSON has no -infinity


class ResponseRenderer:
    """The id, object kind, creation time and model every response and chunk of a request carries,
    and each choice's state across chunks (role sent, logprob text offset)."""

    def __init__(self, request_id: str, chat: bool, model: str, return_token_ids: bool,
                 num_logprobs: int | None = None):
        self.request_id, self.chat, self.model = request_id, chat, model
        self.return_token_ids = return_token_ids
        self.num_logprobs = num_logprobs
        self.created = int(time.time())
        self._role_sent: set[int] = set()
        self._offsets: dict[int, int] = {}

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, index: int, logprobs: list | None) -> dict | None:
        """A choice's `logprobs` for some tokens (engine TokenLogprobs), in the OpenAI shape."""
        if self.num_logprobs is None or logprobs is None:
            return None
        if self.chat:
            return {"content": [{"token": lp.text, "logprob": max(lp.logprob, LOGPROB_FLOOR),
                                 "bytes": list(lp.text.encode()),
                                 "top_logprobs": [{"token": text, "logprob": max(v, LOGPROB_FLOOR),
                                                   "bytes": list(text.encode())} for _, text, v in lp.top]}
                                for lp in logprobs]}
        offset, offsets = self._offsets.get(index, 0), []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.text)
        self._offsets[index] = offset
        # The legacy shape lists the chosen token among the alternatives, as OpenAI does.
        tops = [{**{text: max(v, LOGPROB_FLOOR) for _, text, v in lp.top}, lp.text: max(lp.logprob, LOGPROB_FLOOR)}
                for lp in logprobs]
        return {"tokens": [lp.text for lp in logprobs],
                "token_logprobs": [max(lp.logprob, LOGPROB_FLOOR) for lp in logprobs],
                "top_logprobs": tops, "text_offset": offsets}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, index: int = 0,
              logprobs: list | None = None, usage_so_far: dict | None = None) -> dict:
        """One server-sent event's document for one choice's new text."""
        if self.chat:
            delta = {"content": text}
            if index not in self._role_sent:
                delta = {"role": "assistant", "content": text}
                self._role_sent.add(index)
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(index, logprobs),
                      "finish_reason": finish_reason}
            doc = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text, "logprobs": self.logprobs(index, logprobs),
                      "finish_reason": finish_reason}
            doc = self._head("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        doc["choices"] = [choice]
        if usage_so_far is not None:
            doc["usage"] = usage_so_far
        return doc

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        doc = self._head("chat.completion.chunk" if self.chat else "text_completion")
        doc.update(choices=[], usage=usage(prompt_tokens, completion_tokens))
        return doc

    def response(self, choices: list[tuple[str, list[int], str | None, list | None]], prompt_tokens: int) -> dict:
        """The whole (non-streaming) response: one (text, token ids, finish reason, logprobs) per choice."""
        rendered = []
        for index, (text, token_ids, finish_reason, logprobs) in enumerate(choices):
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text},
                          "logprobs": self.logprobs(index, logprobs), "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": self.logprobs(index, logprobs),
                          "finish_reason": finish_reason}
            if self.return_token_ids:
                choice["token_ids"] = token_ids
            rendered.append(choice)
        doc = self._head("chat.completion" if self.chat else "text_completion")
        doc.update(choices=rendered, usage=usage(prompt_tokens, sum(len(c[1]) for c in choices)))
        return doc


# --- response models, for the OpenAPI schema only -----------------------------------------------
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


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
