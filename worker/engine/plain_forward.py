"""A step without proposals: the target's one forward over prompt chunks and decode rows."""
from __future__ import annotations

import torch

from vramledger.worker.engine.sampler import draw
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.engine.step_context import StepContext


def plain_forward(step: StepContext, prefill: list[Sequence], chunks: list[int],
                  decode: list[Sequence]) -> tuple[list[Sequence], list[list[int]], list]:
    """Each prefill row's next chunk of prompt and each decode row's next token, in one target
    forward: the rows whose prompt this completes and the decode rows draw a token. Returns those
    rows, their tokens and logprobs."""
    starts = [s.num_cached for s in prefill]
    rows = [s.tokens_from(n, n + c) for s, n, c in zip(prefill, starts, chunks)]
    tables = [s.block_table for s in prefill]
    parts = [(rows, starts, tables, 1, True)] if prefill else []
    if decode:
        parts.append(([[s.last_token_id] for s in decode], [len(s) - 1 for s in decode],
                      [s.block_table for s in decode], 1, False))
    parted = [part[:, 0] for part in step.runner.forward_parts("target", parts)]
    done = [i for i, (s, c) in enumerate(zip(prefill, chunks)) if s.num_cached + c == len(s)]
    if prefill:  # the draft reads prompts only when a step proposes for them (SpeculativeStep.catch_up)
        for s, c in zip(prefill, chunks):
            step.stats.prompt_tokens += c
            s.num_cached += c
            s.prefilled = s.num_cached == len(s)
            if not s.prefilled:
                step.blocks.commit(s)  # its full blocks are reusable before its prefill ends
        if len(done) < len(prefill):
            parted[0] = parted[0][torch.tensor(done, dtype=torch.long, device=parted[0].device)]
    for s in decode:
        s.num_cached = len(s)
    seqs = [prefill[i] for i in done] + decode
    if not seqs:
        return [], [], []
    logits = parted[0] if len(parted) == 1 else torch.cat(parted)
    tokens = draw(logits, step.sampling.rows(seqs))
    return seqs, [[t] for t in tokens.tolist()], step.sampling.logprobs(seqs, logits[:, None], tokens[:, None])
