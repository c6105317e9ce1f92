"""Continuous batching: admit, chunk, grow and preempt requests between steps (torch-free)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.sequence import Sequence, Status


@dataclass
class Batch:
    """What one engine step runs: prompts' chunks (prefill) and one token per decoding request."""

    prefill: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # each prefill row's new tokens, from its num_cached on
    decode: list[Sequence] = field(default_factory=list)


@dataclass
class Step:
    """A prefill step's rows as they are added: the padded width and the attention's cost."""

    rows: int = 0
    width: int = 0
    attention: float = 0.0

    def cost_with(self, take: int, attention: float) -> float:
        """Its cost in tokens with one more row: every row padded to the widest, plus attention."""
        return (self.rows + 1) * max(self.width, take) + self.attention + attention

    def add(self, take: int, attention: float) -> None:
        self.rows += 1
        self.width = max(self.width, take)
        self.attention += attention


class Scheduler:
    """FIFO admission under max_num_seqs; long prompts in chunks; newest-first preemption.

    The last free slot never goes to an extra choice of a request (n > 1) that already runs one: a
    request with as many choices as slots runs all but one at a time, and the request behind it starts
    in the next step instead of waiting for every choice to end.

    A step decodes every running request and prefills prompts' chunks beside them, as vLLM's steps
    do: a stream never waits for a chunk in a step of its own, and a prompt starts in the next step
    whatever the streams are doing. The chunks cost their tokens, padded to the widest row, plus
    their attention counted in tokens' matmuls (a chunk after a long cached prefix costs more than
    its tokens); a step computes at most max_num_batched_tokens prompt tokens. Prompts share a step
    while its cost stays within join_tokens: where a forward costs little besides its tokens (the
    CPU), prompts that cost much go one a step, so the first of a burst answers first, and prompts
    that arrive together start decoding a step apart, so they finish apart too and the requests that
    follow them do not queue behind each other.

    A step's decode rows and chunks are separate parts of one forward where the model's one-call
    forward takes both (ModelRunner.forward_parts), else two forwards.
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int, attention_span: float = float("inf"), join_tokens: int | None = None):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead  # draft slots a decode step writes past the last token
        # Context positions a token's attention reads for the cost of its matmuls (ModelRunner.
        # attention_span): a chunk after a long context costs more than its tokens.
        self.attention_span = attention_span
        # The cost up to which prompts share a prefill step (None: the whole budget).
        self.join_tokens = max_num_batched_tokens if join_tokens is None else join_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """Every decoding request's next token (their slots first: they may preempt), then prompts'
        chunks; no request is admitted in a step that preempted one, which would only come back."""
        preempted = self.num_preemptions
        batch = Batch(decode=self._grow_running())
        self._prefill_rows(batch, admit=self.num_preemptions == preempted)
        return batch if batch.prefill or batch.decode else None

    def _prefill_rows(self, batch: Batch, admit: bool) -> None:
        """Prompts being prefilled, then (when `admit`) waiting requests in order (each starting after
        its cached prefix), as _chunk lets them in."""
        step = Step()
        for seq in self.running:
            if not seq.prefilled:
                take = self._chunk(len(seq) - seq.num_cached, seq.num_cached, step)
                if not take:
                    return
                self._add_row(batch, step, seq, take, seq.num_cached)
        if not (admit and self.waiting and len(self.running) < self.max_num_seqs):
            return
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                break
            if self._keeps_the_last_slot(seq):
                continue  # the requests behind it may take the slot
            cached = self.blocks.cached_prefix(seq)
            start = len(cached) * self.blocks.block_size
            take = self._chunk(len(seq) - start, start, step)
            if not take or not self.blocks.can_admit(seq, cached):
                break
            self.waiting.remove(seq)
            self.blocks.admit(seq, cached)
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            self._add_row(batch, step, seq, take, start)

    def _keeps_the_last_slot(self, seq: Sequence) -> bool:
        """Whether admitting `seq` would fill the last free slot with an extra choice of a request that
        already runs one: it waits instead, so no request holds every slot and the next request starts
        at once (with one slot in all, choices take it in turn)."""
        return (bool(seq.group) and self.max_num_seqs - len(self.running) == 1 < self.max_num_seqs
                and any(other.group == seq.group for other in self.running))

    def _add_row(self, batch: Batch, step: Step, seq: Sequence, take: int, start: int) -> None:
        step.add(take, self._attention(start, take))
        batch.prefill.append(seq)
        batch.chunks.append(take)

    def _chunk(self, left: int, start: int, step: Step) -> int:
        """Tokens a row with `left` to prefill from position `start` gets in this step (0: none).
        The first row takes all of them, or the whole budget. Other rows join only while the step's
        cost stays within join_tokens: prompts that cost much, such as chunks after a long cached
        prefix, are prefilled one a step, so that the first of a burst answers while the rest wait;
        small ones share a step. A prompt longer than the budget may join with a first chunk as wide
        as the step."""
        budget = self.max_num_batched_tokens
        if not step.rows:
            return min(left, budget)
        limit = min(self.join_tokens, budget)
        # Only a prompt that goes in chunks anyway (longer than the budget) is cut to fit.
        for take in (left, step.width) if left > budget else (left,):
            if step.cost_with(take, self._attention(start, take)) <= limit:
                return take
        return 0

    def _attention(self, start: int, take: int) -> float:
        """What `take` tokens from position `start` cost in attention, in tokens' matmuls."""
        return take * (start + (take + 1) / 2) / self.attention_span

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
