"""A request as the scheduler sees it: tokens, progress, blocks (torch-free)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vramledger.worker.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request: its prompt, its output so far and its place in the KV cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str = ""  # the request this is one choice of, when it has several (n > 1); "": its own
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    block_table: list[int] = field(default_factory=list)
    # Tokens whose keys and values sit in the cache, per model. The last committed
    # token is never cached yet: it is the next forward's input.
    num_cached: int = 0
    num_draft_cached: int = 0
    # Whether its prefill is done (the prompt; after a preemption, every token so far): it decodes.
    prefilled: bool = False
    # The prefix cache (block_manager.py): hashes of its full blocks, how many of its blocks are
    # registered and how many are marked as holding the draft's keys and values.
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_drafted_blocks: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # Speculative decoding, per request.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def tokens_from(self, start: int, end: int | None = None) -> list[int]:
        """token_ids[start:end] without copying the whole prompt (a step reads a row's last few)."""
        n = len(self.prompt_token_ids)
        end = len(self) if end is None else end
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - n)]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def reset_for_recompute(self) -> None:
        """After preemption: nothing is cached; prompt and output are recomputed later."""
        self.num_cached = self.num_draft_cached = 0
        self.num_registered_blocks = self.num_drafted_blocks = 0
        self.prefilled = False
        self.block_table = []
        self.status = Status.WAITING
        self.num_preemptions += 1
