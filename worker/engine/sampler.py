"""Turning logits into probabilities and tokens, per request, without host syncs."""
from __future__ import annotations

import torch

from worker.engine.penalties import History
from worker.engine.sampling_params import SamplingParams


class RowParams:
    """Per-row sampling settings of a batch as tensors, plus each row's generator and history."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None],
                 device: torch.device, history: History | None = None):
        self.greedy = torch.tensor([p.greedy for p in params], device=device)
        self.all_greedy = bool(self.greedy.all())
        self.temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                        device=device)
        self.top_k = torch.tensor([p.top_k for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device)
        self.needs_filter = any(p.top_k > 0 or p.top_p < 1 for p in params)
        self.generators = generators
        self.history = history  # penalties and min_tokens; None when no row has any

    def expand(self, n: int) -> RowParams:
        """The same settings for n positions per row (rows repeated, row-major)."""
        out = object.__new__(RowParams)
        out.greedy = self.greedy.repeat_interleave(n)
        out.all_greedy = self.all_greedy
        out.temperature = self.temperature.repeat_interleave(n)
        out.top_k = self.top_k.repeat_interleave(n)
        out.top_p = self.top_p.repeat_interleave(n)
        out.needs_filter = self.needs_filter
        out.generators = [g for g in self.generators for _ in range(n)]
        out.history = None  # per-position histories: History.adjust_positions before expanding
        return out


def probabilities(logits: torch.Tensor, rows: RowParams, proposed: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] logits -> [N, V] probabilities after penalties, temperature, top-k and top-p.

    `proposed` [N, j]: draft tokens after the committed output that the history must include.
    """
    if rows.history is not None:
        logits = rows.history.adjust(logits, proposed)
    logits = logits / rows.temperature[:, None]
    if rows.needs_filter:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        drop = (rows.top_k[:, None] > 0) & (rank >= rows.top_k[:, None])
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= rows.top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(-1)


def exponential_noise(shape_v: int, n: int, generators: list[torch.Generator | None],
                      device: torch.device) -> torch.Tensor:
    """[n, V] Exp(1) draws, row i from generators[i] so a seeded request ignores its batch."""
    return torch.stack([torch.empty(shape_v, device=device).exponential_(generator=g)
                        for g in generators[:n]])


def sample(probs: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """[N, V] -> [N] tokens: argmax for greedy rows, the exponential race for the others."""
    greedy_tokens = probs.argmax(-1)
    if rows.all_greedy:
        return greedy_tokens
    noise = exponential_noise(probs.shape[-1], probs.shape[0], rows.generators, probs.device)
    sampled = (probs / noise).argmax(-1)
    return torch.where(rows.greedy, greedy_tokens, sampled)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                 ) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """The model's own log-probabilities (before any sampling setting) of [N] chosen tokens,
    and the num_top most likely tokens of each [N, V] row with theirs."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    if num_top == 0:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    values, ids = logprobs.topk(num_top, dim=-1)
    return chosen, ids.tolist(), values.tolist()
