"""Per-request generation settings."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs


@dataclass
class SamplingParams:
    """How one request samples, what it reports and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 disables
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # end-of-text, stop tokens and stop strings wait until this many tokens
    # Penalties (OpenAI's and vLLM's definitions): presence and frequency subtract from the logits
    # of tokens already generated; repetition divides (or multiplies, when negative) the logits of
    # tokens in the prompt or the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; N: the chosen token's and the N most likely ones

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError("temperature must be a finite number >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop token ids must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be a finite number > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
