"""Continuous batching: admit, grow and preempt requests between steps (torch-free)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import Sequence, Status


@dataclass
class Batch:
    """What one engine step runs: whole prompts (prefill) or one token per request (decode)."""

    is_prefill: bool
    seqs: list[Sequence]


class Scheduler:
    """FIFO admission under max_num_seqs / max_num_batched_tokens; newest-first preemption."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead  # draft slots a decode step writes past the last token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        prefill = self._admit_waiting()
        if prefill:
            return Batch(is_prefill=True, seqs=prefill)
        decode = self._grow_running()
        return Batch(is_prefill=False, seqs=decode) if decode else None

    def _admit_waiting(self) -> list[Sequence]:
        batch: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Rows are padded to the longest prompt: the padded size is what the forward costs.
            if (len(batch) + 1) * max(longest, len(seq)) > self.max_num_batched_tokens:
                break
            if not self.blocks.can_allocate(seq, len(seq)):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, len(seq))
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            batch.append(seq)
            longest = max(longest, len(seq))
        return batch

    def _grow_running(self) -> list[Sequence]:
        batch: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
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
        """Free the newest request's blocks; it is recomputed from its tokens when readmitted."""
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
