"""The block pool shared by target and draft, per-request block tables and the prefix cache (torch-free).

A full block whose keys and values hold committed tokens is registered under a hash chained over
its tokens and every block before it, so equal hashes mean equal prefixes. A request whose tokens
start with registered blocks takes them instead of computing them again. A block no request holds
stays registered, in least-recently-used order, until a fresh block is needed: cached blocks are
part of the KV cache the ledger declares, never memory of their own.
"""
from __future__ import annotations

from collections import OrderedDict

from vramledger.worker.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[int]:
    """The hashes of seq's first `num_blocks` full blocks, each over its tokens and the hash before it.

    Kept on the request: its tokens only ever grow, so a hash once computed stays right.
    """
    hashes = seq.block_hashes
    for i in range(len(hashes), num_blocks):  # only the new blocks' tokens are copied, not the prompt
        hashes.append(hash((hashes[-1] if hashes else 0, *seq.tokens_from(i * block_size, (i + 1) * block_size))))
    return hashes[:num_blocks]


class BlockManager:
    """Hands out fixed-size KV blocks (one table per request covers both models' layers), counts
    who holds each, and keeps full committed blocks for requests that start with the same tokens."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._refs = [0] * num_blocks  # requests holding each block
        self._hash: list[int | None] = [None] * num_blocks  # set while registered
        self._draft_written = [False] * num_blocks  # the draft's keys and values are there too
        self._registered: dict[int, int] = {}  # hash -> block
        # Blocks no request holds, least recently used first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_cached = 0  # free blocks that are still registered
        self.queried_tokens = 0  # tokens of admitted requests looked up in the cache
        self.hit_tokens = 0  # of those, tokens found there

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: taking a fresh block evicts one)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - len(self._free)

    # -- growing and shrinking a request's table ----------------------------------------------
    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        """Extra blocks `seq` needs so that `num_slots` cache slots exist."""
        return max(0, blocks_for(num_slots, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_slots: int) -> bool:
        return self.blocks_needed(seq, num_slots) <= len(self._free)

    def allocate(self, seq: Sequence, num_slots: int) -> None:
        need = self.blocks_needed(seq, num_slots)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        seq.block_table.extend(self._fresh() for _ in range(need))

    def trim(self, seq: Sequence, num_slots: int) -> None:
        """Return the blocks past `num_slots` (rejected draft slots no longer need them)."""
        keep = blocks_for(num_slots, self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        # Last block first: of a request's blocks, its tail is the least likely to be shared again.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache index of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # -- the prefix cache -------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks seq's tokens start with. Never the block of its last token: the
        prefill computes at least that token (its logits), and never writes into a shared block."""
        if not self.caching:
            return []
        found = []
        for h in chain_hashes(seq, self.block_size, (len(seq) - 1) // self.block_size):
            block = self._registered.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_admit(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether a waiting request fits with its cached prefix `cached` (from cached_prefix)."""
        taken_from_free = sum(self._refs[b] == 0 for b in cached)
        return blocks_for(len(seq), self.block_size) - len(cached) + taken_from_free <= len(self._free)

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give a waiting request its cached prefix, then fresh blocks for the rest of its tokens.
        The draft starts after the first cached block it has not written (a dormant draft's)."""
        for block in cached:  # held before any fresh block is taken, which could evict them
            self._hold(block)
        seq.block_table = list(cached)
        drafted = next((i for i, b in enumerate(cached) if not self._draft_written[b]), len(cached))
        seq.num_cached, seq.num_draft_cached = len(cached) * self.block_size, drafted * self.block_size
        seq.num_registered_blocks, seq.num_drafted_blocks = len(cached), drafted
        if self.caching:
            self.queried_tokens += len(seq)
            self.hit_tokens += seq.num_cached
        self.allocate(seq, len(seq))

    def commit(self, seq: Sequence) -> None:
        """Register seq's full blocks below num_cached (committed tokens only: rejected draft slots
        lie past it) and mark those below num_draft_cached as holding the draft's keys and values."""
        if not self.caching:
            return
        full = seq.num_cached // self.block_size
        if full > seq.num_registered_blocks:
            hashes = chain_hashes(seq, self.block_size, full)
            for i in range(seq.num_registered_blocks, full):
                block, h = seq.block_table[i], hashes[i]
                if self._hash[block] is None and h not in self._registered:  # an equal block may be there
                    self._hash[block], self._registered[h] = h, block
            seq.num_registered_blocks = full
        drafted = min(seq.num_draft_cached, seq.num_cached) // self.block_size
        for i in range(seq.num_drafted_blocks, drafted):
            self._draft_written[seq.block_table[i]] = True
        seq.num_drafted_blocks = max(seq.num_drafted_blocks, drafted)

    def skip_drafted(self, seq: Sequence) -> int:
        """Move seq's draft past the full blocks at its position whose draft keys and values another
        request's draft already wrote (a shared prefix it is catching up on). Returns the block the
        draft writes next."""
        i = seq.num_draft_cached // self.block_size
        if seq.num_draft_cached % self.block_size == 0:
            full = seq.num_cached // self.block_size
            while i < full and self._draft_written[seq.block_table[i]]:
                i += 1
            seq.num_draft_cached = max(seq.num_draft_cached, i * self.block_size)
            seq.num_drafted_blocks = max(seq.num_drafted_blocks, i)
        return seq.block_table[i]

    def draft_backlog(self, seqs: list[Sequence], lag: int) -> int:
        """Tokens the draft's catch-up would read for seqs (SpeculativeStep.catch_up): each row that
        lags more than `lag` tokens, up to its last token, with blocks another draft wrote skipped and
        blocks rows share read once."""
        seen: set[int] = set()
        tokens = 0
        for s in seqs:
            start, end = s.num_draft_cached, len(s) - 1
            if end - start <= lag:
                continue
            for i in range(start // self.block_size, (end - 1) // self.block_size + 1):
                block = s.block_table[i]
                if block not in seen and not self._draft_written[block]:
                    seen.add(block)
                    tokens += min(end, (i + 1) * self.block_size) - max(start, i * self.block_size)
        return tokens

    # -- one block --------------------------------------------------------------------------------
    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
            self.num_cached -= self._hash[block] is not None
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None  # most recently used: evicted last
            self.num_cached += self._hash[block] is not None

    def _fresh(self) -> int:
        """The least recently used free block, its registration (if any) dropped."""
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:
            del self._registered[h]
            self._hash[block] = None
            self.num_cached -= 1
        self._draft_written[block] = False
        self._refs[block] = 1
        return block
