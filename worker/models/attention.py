"""Paged attention inputs shared by every layer of one forward (padded batch layout)."""
from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch


@dataclass
class BlockTables:
    """The rows' block tables as tensors, built once per engine step for its draft and target forwards."""

    slots: torch.Tensor  # [B, M * block_size] cache slot of every position the tables cover

    @classmethod
    def build(cls, tables: list[list[int]], block_size: int, device: torch.device) -> BlockTables:
        # Short rows are padded with block 0: positions past a row's context are masked or never written.
        M = max(len(t) for t in tables)
        blocks = host_longs([b for t in tables for b in t + [0] * (M - len(t))], device).view(len(tables), M)
        return cls((blocks[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1))

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, P] positions -> [B, P] cache slots."""
        return self.slots.gather(1, positions)


class GatherWorkspace:
    """Buffers that forwards gather their keys and values into, kept from step to step.

    On the CPU a fresh buffer over glibc's mmap threshold (device.py) is a new mapping whose pages
    fault in when first written: a 16-row gather into a fresh tensor took 340 us, into a kept
    one 16 us. A pair grows to the largest step seen, which the profile run measured first,
    so serving never holds more than that run's peak.
    """

    def __init__(self) -> None:
        self._pairs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def pair(self, rows: int, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers [rows, kvH, D] for one layer's cache [slots, kvH, D]."""
        key = (tuple(cache.shape[1:]), cache.dtype, cache.device)
        held = self._pairs.get(key)
        if held is None or held[0].shape[0] < rows:
            self._pairs.pop(key, None)  # the smaller pair goes before the larger one is made
            shape = (rows, *cache.shape[1:])
            held = self._pairs[key] = (torch.empty(shape, dtype=cache.dtype, device=cache.device),
                                       torch.empty(shape, dtype=cache.dtype, device=cache.device))
        return held[0][:rows], held[1][:rows]

    def nbytes(self) -> int:
        return sum(t.nbytes for pair in self._pairs.values() for t in pair)

    def clear(self) -> None:
        self._pairs.clear()


@dataclass
class PagedBatch:
    """One forward over B rows of up to Q new tokens each, reading C context slots per row.

    Rows are left-aligned and padded; padded query positions attend to slot 0 only
    (a harmless, finite softmax) and their keys are never written.
    """

    input_ids: torch.Tensor  # [B, Q]
    positions: torch.Tensor  # [B, Q]
    write_rows: torch.Tensor | None  # [N] indices into the flattened [B*Q] tokens that are real; None: all are
    write_slots: torch.Tensor  # [N] cache slots those tokens fill
    gather_slots: torch.Tensor  # [B, C] cache slot of context position c of row b
    context_lens: torch.Tensor  # [B]
    logits_index: torch.Tensor  # [B, n] query positions whose logits are wanted
    from_start: bool  # every row starts at position 0 (a prompt's prefill): its context is its own tokens
    prefill: bool  # the new tokens are prompts' (from_start, or chunks after cached ones), not generated
    # Where each layer's context is gathered: the runner's, kept between steps; else one for this batch.
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace)

    def mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, Q, C] additive mask, 0 where query q may attend context position c, else -inf.

        Built once per forward: a boolean mask would be converted again by every layer's attention.
        """
        cache = self.__dict__.setdefault("_masks", {})
        key = (sliding_window, dtype)
        if key not in cache:
            col = torch.arange(self.gather_slots.shape[1], device=self.positions.device)
            pos = self.positions[:, :, None]
            allowed = (col <= pos) & (col < self.context_lens[:, None, None])
            if sliding_window is not None:
                allowed &= col > pos - sliding_window
            blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            cache[key] = blocked.masked_fill_(~allowed, float("-inf"))[:, None]
        return cache[key]

    def context_buffers(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where one layer's keys and values [B * C, kvH, D] are gathered: every layer reuses them."""
        return self.workspace.pair(self.gather_slots.numel(), cache)


def host_longs(values: list[int], device: torch.device) -> torch.Tensor:
    """[len(values)] int64 from a host list. Through a buffer: torch.tensor converts element by
    element (9 us for 1 value, 30 for 80), frombuffer copies bytes (3-5 us)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.long).to(device)


def build_paged_batch(token_rows: list[list[int]], start_positions: list[int],
                      block_tables: list[list[int]] | BlockTables, block_size: int, num_logits: int,
                      device: torch.device, input_ids: torch.Tensor | None = None,
                      prefill: bool = False) -> PagedBatch:
    """Lay out rows of new tokens (row b starts at position start_positions[b]); `input_ids`
    [B, Q], when given, holds the rows' tokens already (draft proposals living on the device);
    `prefill`: the rows are prompts' chunks (a batch from position 0 always is).

    Each field is one tensor made from a host list: a decode step's batch is a few elements, and
    each torch op costs more than the Python that replaces it.
    """
    tables = block_tables if isinstance(block_tables, BlockTables) else \
        BlockTables.build(block_tables, block_size, device)
    B, q_lens = len(token_rows), [len(r) for r in token_rows]
    Q = max(q_lens)
    ends = [s + n for s, n in zip(start_positions, q_lens)]
    context = max(ends)
    if context > tables.slots.shape[1]:
        raise ValueError(f"the block tables cover {tables.slots.shape[1]} positions, the rows reach {context}")
    # Padded queries sit at position 0 and write nothing.
    positions = host_longs([s + q if q < n else 0 for s, n in zip(start_positions, q_lens) for q in range(Q)],
                           device).view(B, Q)
    write_slots = tables.at(positions).flatten()
    write_rows = None
    if min(q_lens) < Q:
        write_rows = host_longs([b * Q + q for b, n in enumerate(q_lens) for q in range(n)], device)
        write_slots = write_slots[write_rows]
    if input_ids is None:
        input_ids = host_longs([t for r in token_rows for t in r + [0] * (Q - len(r))], device).view(B, Q)
    logits_index = host_longs([max(0, n - num_logits + i) for n in q_lens for i in range(num_logits)],
                              device).view(B, num_logits)
    return PagedBatch(
        input_ids=input_ids, positions=positions, write_rows=write_rows, write_slots=write_slots,
        gather_slots=tables.slots[:, :context].contiguous(), context_lens=host_longs(ends, device),
        logits_index=logits_index, from_start=max(start_positions) == 0,
        prefill=prefill or max(start_positions) == 0)
