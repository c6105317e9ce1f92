"""Turning logits into probabilities and tokens, per request, without host syncs."""
from __future__ import annotations

import torch

from vramledger.worker.engine.penalties import History
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.kernels import draw_tokens


class RowParams:
    """Per-row sampling settings of a batch as tensors, plus each row's generator and history."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None],
                 device: torch.device, history: History | None = None, shared: torch.Generator | None = None):
        """generators[i]: row i's own (a seeded request), or None to draw from `shared` with the
        other such rows in one call (None: torch's default generator)."""
        self.greedy = torch.tensor([p.greedy for p in params], device=device)
        self.all_greedy = bool(self.greedy.all())
        self.any_greedy = any(p.greedy for p in params)
        self.temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                        device=device)
        self.top_k = torch.tensor([p.top_k for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device)
        self.min_p = torch.tensor([p.min_p for p in params], device=device)
        self.needs_filter = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        self.generators = generators
        self.shared = shared
        self.history = history  # penalties and min_tokens; None when no row has any

    def expand(self, n: int) -> RowParams:
        """The same settings for n positions per row (rows repeated, row-major)."""
        out = object.__new__(RowParams)
        out.greedy = self.greedy.repeat_interleave(n)
        out.all_greedy, out.any_greedy = self.all_greedy, self.any_greedy
        out.temperature = self.temperature.repeat_interleave(n)
        out.top_k = self.top_k.repeat_interleave(n)
        out.top_p = self.top_p.repeat_interleave(n)
        out.min_p = self.min_p.repeat_interleave(n)
        out.needs_filter = self.needs_filter
        out.generators = [g for g in self.generators for _ in range(n)]
        out.shared = self.shared
        out.history = None  # per-position histories: History.adjust_positions before expanding
        return out


def probabilities(logits: torch.Tensor, rows: RowParams, proposed: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] logits -> [N, V] probabilities after penalties, temperature, top-k, top-p and min-p.

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
        # min-p: below min_p x the top token's probability (a ratio top-k and top-p leave unchanged).
        drop |= sorted_probs < rows.min_p[:, None] * sorted_probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(-1)


def row_draws(shape: tuple[int, ...], rows: RowParams, device: torch.device, draw) -> torch.Tensor:
    """[n, *shape] random draws (n = len(rows.generators)), `draw(tensor, generator)` filling them:
    all rows in one call from the shared generator, then each seeded row again from its own, so
    that a seeded request ignores its batch and the others cost one call (not one per row)."""
    out = draw(torch.empty(len(rows.generators), *shape, device=device), rows.shared)
    for i, g in enumerate(rows.generators):
        if g is not None:
            draw(out[i], g)
    return out


def uniforms(rows: RowParams, device: torch.device, per_row: int = 1) -> torch.Tensor:
    """[n, per_row] draws in [0, 1)."""
    return row_draws((per_row,), rows, device, lambda t, g: t.uniform_(generator=g))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, V] non-negative weights (each row's sum > 0, not necessarily 1), [N, 1] uniforms in
    [0, 1) -> [N] tokens, each drawn with probability weight / row sum.

    One uniform per row, where the exponential race draws one per vocabulary entry: 10-25x faster at
    16 rows (bench/sampler.py). The token is the first whose cumulative weight exceeds u x sum;
    u x sum is kept below the sum, so the token's own weight is never 0.
    """
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def sample(probs: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """[N, V] -> [N] tokens: argmax for greedy rows, a draw from probs for the others."""
    greedy_tokens = probs.argmax(-1)
    if rows.all_greedy:
        return greedy_tokens
    return torch.where(rows.greedy, greedy_tokens, inverse_cdf(probs, uniforms(rows, probs.device)))


def only_temperature(logits: torch.Tensor, rows: RowParams) -> bool:
    """Whether every row samples at a temperature only (no greedy row, penalty, top-k, top-p or min-p)
    from float32 logits on the CPU: the rows the C kernels (draw_tokens.c, verify_tokens.c) take."""
    return not (rows.any_greedy or rows.needs_filter or rows.history is not None) and \
        logits.device.type == "cpu" and logits.dtype == torch.float32


def _draws_in_c(logits: torch.Tensor, rows: RowParams) -> bool:
    return only_temperature(logits, rows) and draw_tokens.available()


def draw(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """[N, V] logits -> [N] tokens: `sample(probabilities(logits, rows), rows)`, in one C call
    (draw_tokens.c) where it can. Same uniforms, same law; the last bits of the weights differ, so
    a seeded request may draw another token than the torch path would."""
    if not _draws_in_c(logits, rows):
        return sample(probabilities(logits, rows), rows)
    return draw_tokens.draw_tokens(logits, rows.temperature, uniforms(rows, logits.device))


def propose(logits: torch.Tensor, rows: RowParams, proposed: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft step: [N, V] logits -> (q [N, V], [N] tokens drawn from q), q being what verification
    divides by. One C call where `draw` makes one: the torch path's five ops took 0.2 ms a draft
    step at 1 row, a third of what the draft's forward takes."""
    if not _draws_in_c(logits, rows):
        q = probabilities(logits, rows, proposed)
        return q, sample(q, rows)
    q = torch.empty(logits.shape, dtype=torch.float32)  # dense row-major, as the kernel writes it
    return q, draw_tokens.draw_tokens(logits, rows.temperature, uniforms(rows, logits.device), probs=q)


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
