"""A step with proposals: the draft catches up and proposes k tokens per row, the target verifies
them in one forward, and both caches roll back to what was accepted."""
from __future__ import annotations

import torch

from vramledger.worker.engine.sampler import RowParams, propose
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.engine.spec_decode import verify_logits
from vramledger.worker.engine.speculation import CATCH_UP_AFTER, Speculation
from vramledger.worker.engine.step_context import StepContext
from vramledger.worker.models.attention import BlockTables


class SpeculativeStep:
    """Decode rows through the draft and the target: the engine's step and the profile run's."""

    def __init__(self, step: StepContext, max_num_batched_tokens: int):
        self.step = step
        self.max_num_batched_tokens = max_num_batched_tokens  # the catch-up's chunks share it

    def __call__(self, seqs: list[Sequence], k: int,
                 policy: Speculation) -> tuple[list[list[int]], list[int], list]:
        """Each row's emitted tokens, its accepted proposals, its logprobs. `policy` learns what the
        draft's catch-up cost."""
        self.catch_up(seqs, policy)
        tables = self.step.runner.block_tables([s.block_table for s in seqs])
        rp = self.step.sampling.rows(seqs)
        drafts, draft_probs = self.propose(seqs, k, tables, rp)
        accepted, tokens, logits = self.verify(seqs, drafts, draft_probs, tables, rp)
        self.roll_back(seqs, accepted, k)
        emitted = [row[:n + 1] for row, n in zip(tokens.tolist(), accepted)]
        return emitted, accepted, self.step.sampling.logprobs(seqs, logits, tokens)

    def catch_up(self, seqs: list[Sequence], policy: Speculation) -> None:
        """The draft reads what it has not (its requests' prompts, the tokens of steps that did not
        propose; no logits), where a row lags more than CATCH_UP_AFTER tokens: up to its last token,
        which its first proposal reads, in prompt chunks within the prefill's token budget. Rows that
        share cached blocks read them once: one writes a block, the others skip it. Its time is left
        out of the step's cost; the policy learns from it what the draft's reading costs a token."""
        with policy.catching_up() as read:
            while rows := self._behind_the_target(seqs):
                read.append(self.read(rows))

    def backlog(self, seqs: list[Sequence]) -> int:
        """Tokens catch_up would read for seqs now (what the policy weighs before it probes)."""
        return self.step.blocks.draft_backlog(seqs, CATCH_UP_AFTER)

    def read(self, rows: list[Sequence]) -> int:
        """One forward of the catch-up: each row's next chunk up to its last token. Returns the tokens read."""
        width = max(1, self.max_num_batched_tokens // len(rows))
        starts = [s.num_draft_cached for s in rows]
        chunks = [min(width, len(s) - 1 - n) for s, n in zip(rows, starts)]
        self.step.runner.forward("draft", [s.tokens_from(n, n + c) for s, n, c in zip(rows, starts, chunks)],
                                 starts, [s.block_table for s in rows], 0, prefill=True)
        for s, c in zip(rows, chunks):
            s.num_draft_cached += c
            self.step.blocks.commit(s)  # marks its full blocks drafted, for the rows that share them
        return sum(chunks)

    def _behind_the_target(self, seqs: list[Sequence]) -> list[Sequence]:
        """The rows whose draft lags more than CATCH_UP_AFTER tokens, one per block it writes next:
        rows that share that block wait, then skip it."""
        rows: dict[int, Sequence] = {}
        for s in seqs:
            block = self.step.blocks.skip_drafted(s)
            if len(s) - s.num_draft_cached > CATCH_UP_AFTER:
                rows.setdefault(block, s)
        return list(rows.values())

    def propose(self, seqs: list[Sequence], k: int, tables: BlockTables,
                rp: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft steps: proposals [B, k] and the draft's probabilities [B, k, V]. The first step also
        reads the tokens the draft has not seen (the bonus token, or the last of a catch-up)."""
        B = len(seqs)
        lens = [len(s) for s in seqs]
        rows = [s.tokens_from(s.num_draft_cached) for s in seqs]
        starts = [s.num_draft_cached for s in seqs]
        feed = None
        draft_probs: list[torch.Tensor] = []
        draft_tokens: list[torch.Tensor] = []
        for i in range(k):
            logits = self.step.runner.forward("draft", rows, starts, tables, 1, input_ids=feed)[:, 0]
            q, d = propose(logits, rp, torch.stack(draft_tokens, 1) if draft_tokens else None)  # [B, V], [B]
            draft_probs.append(q)
            draft_tokens.append(d)
            rows, starts, feed = [[0]] * B, [n + i for n in lens], d[:, None]
        return torch.stack(draft_tokens, 1), torch.stack(draft_probs, 1)

    def verify(self, seqs: list[Sequence], drafts: torch.Tensor, draft_probs: torch.Tensor, tables: BlockTables,
               rp: RowParams) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The target scores the last token and the k proposals in one forward. Returns each row's
        accepted proposals, its tokens [B, k+1] (row b emits the first accepted[b] + 1) and the target's
        logits [B, k+1, V]."""
        B, k = drafts.shape
        last = torch.tensor([s.last_token_id for s in seqs], device=self.step.runner.device)[:, None]
        logits = self.step.runner.forward("target", [[0] * (k + 1)] * B, [len(s) - 1 for s in seqs], tables,
                                          k + 1, input_ids=torch.cat([last, drafts], 1))  # [B, k+1, V]
        num_accepted, tokens = verify_logits(drafts, draft_probs, logits, rp)
        return num_accepted.tolist(), tokens, logits

    def roll_back(self, seqs: list[Sequence], accepted: list[int], k: int) -> None:
        """Only the accepted proposals' keys and values stay valid, in either cache."""
        for s, n in zip(seqs, accepted):
            length = len(s)
            s.num_cached = length + n
            s.num_draft_cached = min(length + k - 1, length + n)
            s.num_draft_tokens += k
            s.num_accepted_tokens += n
        self.step.stats.record_verification(accepted, k)
