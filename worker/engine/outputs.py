"""What the engine hands back after each step, and the running statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the target, and the most likely alternatives."""

    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]  # (token id, text, logprob), most likely first


@dataclass
class RequestOutput:
    """The tokens and text one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the previous output
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    first_scheduled_time: float | None = None  # time.monotonic() of its first admission into a batch


@dataclass
class EngineStats:
    """Cumulative counters since start; gauges are read from the engine when needed."""

    num_speculative_tokens: int = 0  # K, the most a step proposes
    current_speculative_tokens: int = 0  # k the policy chose for the latest decode step, probes aside
    prompt_tokens: int = 0
    generation_tokens: int = 0
    drafts: int = 0  # one per request per speculative step
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = [0] * self.num_speculative_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculative step: the accepted ones plus the target's own."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def record_verification(self, num_accepted: list[int], k: int) -> None:
        """One speculative step that proposed k tokens per row."""
        self.drafts += len(num_accepted)
        self.draft_tokens += k * len(num_accepted)
        self.accepted_tokens += sum(num_accepted)
        for i in range(k):
            self.accepted_per_position[i] += sum(n > i for n in num_accepted)
