"""The heaviest step the engine will ever run, for measuring the activation peak."""
from __future__ import annotations

import torch

from worker.config import EngineConfig
from worker.engine.model_runner import ModelRunner
from worker.engine.sampler import RowParams, probabilities, sample
from worker.engine.sampling_params import SamplingParams
from worker.engine.spec_decode import verify

# Sampling with top-k and top-p takes the most memory (a sort of the vocabulary).
WORST_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)


def profile_blocks(config: EngineConfig) -> int:
    """Scratch blocks the run writes into: every row shares one longest-sequence table."""
    return config.max_blocks_per_seq


@torch.inference_mode()
def run_worst_case(runner: ModelRunner, config: EngineConfig) -> None:
    """A full prefill batch, then a full speculative decode step at the longest context.

    Rows share one block table: keys and values land on the same scratch slots, which
    costs nothing in activations and keeps the scratch cache small.
    """
    device, k = runner.device, config.num_speculative_tokens
    table = list(range(profile_blocks(config)))
    longest = config.max_model_len

    # Prefill: rows of max_model_len up to the batched-token limit (padded rows cost the same).
    rows = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // longest))
    prompt = [[1] * longest] * rows
    for name in runner.models:
        runner.forward(name, prompt, [0] * rows, [table] * rows, 1 if name == "target" else 0)

    # Decode: every sequence at the longest context, k draft steps then k+1 verified positions.
    B = config.max_num_seqs
    rp = RowParams([WORST_PARAMS] * B, [None] * B, device)
    start = longest - 1
    if k == 0:
        logits = runner.forward("target", [[1]] * B, [start] * B, [table] * B, 1)[:, 0]
        sample(probabilities(logits, rp), rp)
        return
    draft_probs, drafts = [], []
    for i in range(k):
        rows_i = [[1, 1]] * B if i == 0 else [[1]] * B  # the first step may catch up one token
        logits = runner.forward("draft", rows_i, [start - 1 + i] * B, [table] * B, 1)[:, 0]
        q = probabilities(logits, rp)
        draft_probs.append(q)
        drafts.append(sample(q, rp))
    logits = runner.forward("target", [[1] * (k + 1)] * B, [start] * B, [table] * B, k + 1)
    p = probabilities(logits.flatten(0, 1), rp.expand(k + 1)).view(B, k + 1, -1)
    verify(torch.stack(drafts, 1), torch.stack(draft_probs, 1), p, rp)
