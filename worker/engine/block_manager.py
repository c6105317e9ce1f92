"""The block pool shared by target and draft, and per-request block tables (torch-free)."""
from __future__ import annotations

from collections import deque

from worker.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size KV blocks; one table per request covers both models' layers."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        """Extra blocks `seq` needs so that `num_slots` cache slots exist."""
        return max(0, blocks_for(num_slots, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_slots: int) -> bool:
        return self.blocks_needed(seq, num_slots) <= len(self._free)

    def allocate(self, seq: Sequence, num_slots: int) -> None:
        need = self.blocks_needed(seq, num_slots)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def trim(self, seq: Sequence, num_slots: int) -> None:
        """Return the blocks past `num_slots` (rejected draft slots no longer need them)."""
        keep = blocks_for(num_slots, self.block_size)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache index of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
