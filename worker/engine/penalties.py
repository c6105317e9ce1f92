"""Logit adjustments that depend on a request's history: penalties and min_tokens.

Speculative decoding applies them to the draft and to the target at every proposed position,
each time with the same history (the output so far plus the proposals before that position), so
both distributions are conditioned alike and rejection sampling still emits the target's.
"""
from __future__ import annotations

import torch

from vramledger.worker.engine.sampling_params import SamplingParams


class History:
    """Per-row output counts, prompt-or-output presence and end tokens held back by min_tokens."""

    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
                 eos_token_ids: set[int], vocab_size: int, device: torch.device):
        B, V = len(params), vocab_size
        self.presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        self.frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        self.repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        self.counts = torch.zeros(B, V, device=device)  # [B, V] output token counts
        self.seen = torch.zeros(B, V, dtype=torch.bool, device=device)  # [B, V] in prompt or output
        for b, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
            if p.penalized and out:
                self.counts[b].index_add_(0, torch.tensor(out, device=device),
                                          torch.ones(len(out), device=device))
            if p.repetition_penalty != 1.0:
                self.seen[b, torch.tensor(prompt + out, device=device)] = True
        # min_tokens: end-of-text and stop tokens are banned while the output is shorter.
        self.remaining = torch.tensor([p.min_tokens - len(o) for p, o in zip(params, outputs)], device=device)
        self.ban = torch.zeros(B, V, dtype=torch.bool, device=device)
        for b, p in enumerate(params):
            if p.min_tokens > len(outputs[b]):
                ends = [t for t in eos_token_ids | set(p.stop_token_ids) if t < V]
                self.ban[b, ends] = True
        self.has_ban = bool(self.ban.any())

    @staticmethod
    def needed(params: list[SamplingParams], outputs: list[list[int]]) -> bool:
        return any(p.penalized or p.min_tokens > len(o) for p, o in zip(params, outputs))

    def adjust(self, logits: torch.Tensor, proposed: torch.Tensor | None = None) -> torch.Tensor:
        """[B, V] logits -> adjusted logits, the history extended by `proposed` [B, j] tokens."""
        counts, seen, position = self.counts, self.seen, 0
        if proposed is not None and proposed.shape[1]:
            position = proposed.shape[1]
            extra = torch.zeros_like(counts).scatter_add_(1, proposed, torch.ones_like(proposed, dtype=counts.dtype))
            counts, seen = counts + extra, seen | (extra > 0)
        logits = logits.float()
        # Repetition first (it scales), then the subtractive penalties, as vLLM orders them.
        scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(seen, scaled, logits)
        logits = logits - self.frequency * counts - self.presence * (counts > 0).float()
        if self.has_ban:
            banned = self.ban & (self.remaining > position)[:, None]
            logits = logits.masked_fill(banned, float("-inf"))
        return logits

    def adjust_positions(self, logits: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
        """[B, k+1, V] logits of a verification -> adjusted, position j after proposed[:, :j]."""
        return torch.stack([self.adjust(logits[:, j], proposed[:, :j]) for j in range(logits.shape[1])], 1)
