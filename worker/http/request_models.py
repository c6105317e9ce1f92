"""The OpenAI-compatible request bodies the worker accepts (the subset served), validated strictly."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # a request in flight holds its stop strings: the ledger's `server` entry counts them
MAX_NAME_CHARS = 256  # model, user and message names, held the same way
MAX_CHOICES = 16  # n: each choice is a sequence of its own in the engine
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
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

    model: str = Field(max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, description="default: 16 (completions), the rest of "
                                                           "the context (chat)")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=(1 << 31) - 1, description="0 or -1 disables")  # the sampler's int64
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False,
                         description="drop tokens less likely than min_p x the most likely one; 0 disables")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each sampled on its own")
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS,
                             description="the end user, for the client's records: never used or logged")
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
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return options

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

    def drop_texts(self) -> None:
        """Forget the prompt once tokenized: a request in flight holds its token ids, not its text too."""


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or token ids; a list of one of them is accepted too")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="the chosen token's logprob and this many most likely ones")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def drop_texts(self) -> None:
        self.prompt = ""


class TextPart(StrictModel):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat message; content is text or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=MAX_NAME_CHARS,
                             description="the participant's name, given to the chat template")

    @field_validator("content")
    @classmethod
    def _one_text(cls, content: str | list[TextPart]) -> str:
        # The parts joined once: a request holds one string, not an object per part.
        return content if isinstance(content, str) else "".join(p.text for p in content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def drop_texts(self) -> None:
        self.messages = []
