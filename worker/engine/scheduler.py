"""Continuous batching: admit, chunk, grow and preempt requests between steps (torch-free)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence, Status


@dataclass
class Batch:
    """What one engine step runs: prompt chunks (prefill) or one token per request (decode)."""

    is_prefill: bool
    seqs: list[Sequence]
    chunks: list[int] = field(default_factory=list)  # prefill: each row's new tokens, from its num_cached on


class Scheduler:
    """FIFO admission under max_num_seqs; prefill steps of at most max_num_batched_tokens tokens,
    long prompts in chunks; newest-first preemption.

    While prompts are being prefilled and requests decode, prefill and decode steps alternate: a
    running stream waits at most one prefill step (one chunk) for its next tokens. Alternating keeps
    every step one of the two shapes the engine already runs and the profile measures; decode rows
    mixed into a chunk's forward would also mix speculation's draft steps and verification into it.
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead  # draft slots a decode step writes past the last token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._prefilled_last = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        if self._prefilled_last and any(s.prefilled for s in self.running):
            self._prefilled_last = False
            decode = self._grow_running()
            if decode:
                return Batch(is_prefill=False, seqs=decode)
        prefill = self._prefill_rows()
        self._prefilled_last = bool(prefill.seqs)
        if prefill.seqs:
            return prefill
        decode = self._grow_running()
        return Batch(is_prefill=False, seqs=decode) if decode else None

    def _prefill_rows(self) -> Batch:
        """Prompts being prefilled, then waiting requests admitted in order (each starting after its
        cached prefix). Rows are padded to the widest: the padded size is what the forward costs."""
        batch = Batch(is_prefill=True, seqs=[], chunks=[])
        width = 0
        for seq in self.running:
            if not seq.prefilled:
                take = self._chunk(len(seq) - seq.num_cached, len(batch.seqs), width)
                if not take:
                    return batch
                width = max(width, take)
                batch.seqs.append(seq)
                batch.chunks.append(take)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.cached_prefix(seq)
            take = self._chunk(len(seq) - len(cached) * self.blocks.block_size, len(batch.seqs), width)
            if not take or not self.blocks.can_admit(seq, cached):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, cached)
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            width = max(width, take)
            batch.seqs.append(seq)
            batch.chunks.append(take)
        return batch

    def _chunk(self, left: int, rows: int, width: int) -> int:
        """Tokens a row with `left` to prefill gets as row rows+1 of a batch `width` wide (0: none).
        All of them while the widened batch stays within the budget; else, a chunk as wide as the
        batch, or the whole budget when it is the first row."""
        budget = self.max_num_batched_tokens
        if (rows + 1) * max(width, left) <= budget:
            return left
        if rows == 0:
            return budget
        return width if (rows + 1) * width <= budget else 0

    def _grow_running(self) -> list[Sequence]:
        batch: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or not seq.prefilled:
                continue  # preempted earlier in this loop, or still prefilling
            slots = len(seq) + self.lookahead
            while not self.blocks.can_allocate(seq, slots):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.allocate(seq, slots)
                batch.append(seq)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Free the newest request's blocks (a block another request holds stays with it; its
        committed ones stay cached); it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
