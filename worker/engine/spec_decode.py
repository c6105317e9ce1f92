"""Batched verification of draft proposals: greedy matching and rejection sampling."""
from __future__ import annotations

import torch

from vramledger.worker.engine.sampler import RowParams, inverse_cdf, only_temperature, probabilities, uniforms
from vramledger.worker.kernels import verify_tokens


def verify_logits(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, logits: torch.Tensor,
                  rows: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` from the target's logits [B, k+1, V]: the probabilities after each row's penalties
    and sampling settings, then verification; one C call (verify_tokens.c) where every row samples
    at a temperature only, which takes a position's softmax only while its proposals are accepted."""
    B, k = draft_tokens.shape
    if not only_temperature(logits, rows) or not verify_tokens.available():
        # Penalties see the proposals before each position, as the draft saw them when proposing.
        adjusted = logits if rows.history is None else rows.history.adjust_positions(logits, draft_tokens)
        p = probabilities(adjusted.flatten(0, 1), rows.expand(k + 1)).view(B, k + 1, -1)
        return verify(draft_tokens, draft_probs, p, rows)
    u_accept, u_next = uniforms(rows, logits.device, k), uniforms(rows, logits.device)  # as verify draws them
    return verify_tokens.verify_tokens(draft_tokens, draft_probs, logits, rows.temperature, u_accept, u_next)


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
           rows: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's k proposals and add one target token after it.

    draft_tokens [B, k], draft_probs q [B, k, V], target_probs p [B, k+1, V].
    Greedy rows accept while the proposal is the target's argmax. Sampled rows accept
    proposal i with probability min(1, p_i(d)/q_i(d)) and, at the first rejection, draw
    from norm(max(0, p_i - q_i)) (Leviathan et al. 2023, Chen et al. 2023); when all k
    are accepted the extra token is a bonus drawn from p_{k+1}. The emitted tokens are then
    distributed exactly as the target's.
    Returns (num_accepted [B], tokens [B, k+1]); row b emits tokens[b, :num_accepted[b] + 1].
    """
    B, k = draft_tokens.shape
    target_argmax = target_probs.argmax(-1)  # [B, k+1]
    accept = draft_tokens == target_argmax[:, :k]
    if not rows.all_greedy:
        p_d = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
        q_d = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
        u = uniforms(rows, draft_tokens.device, k)
        accept = torch.where(rows.greedy[:, None], accept, u * q_d < p_d)
    num_accepted = accept.int().cumprod(-1).sum(-1)  # [B]

    # The token after the accepted prefix: the target's own choice at that position.
    idx = num_accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])
    p_next = target_probs.gather(1, idx)[:, 0]  # [B, V]
    next_token = target_argmax.gather(1, num_accepted[:, None])[:, 0]
    if not rows.all_greedy:
        rejected = num_accepted < k
        q_next = draft_probs.gather(1, idx.clamp(max=k - 1))[:, 0]
        residual = (p_next - q_next).clamp(min=0)
        # p == q leaves no residual mass; then any draw from p is right.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
        dist = torch.where(rejected[:, None], residual, p_next)
        next_token = torch.where(rows.greedy, next_token, inverse_cdf(dist, uniforms(rows, dist.device)))

    tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
    tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return num_accepted, tokens
