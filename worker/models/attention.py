"""Paged attention inputs shared by every layer of one forward (padded batch layout)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """One forward over B rows of up to Q new tokens each, reading C context slots per row.

    Rows are left-aligned and padded; padded query positions attend to slot 0 only
    (a harmless, finite softmax) and their keys are never written.
    """

    input_ids: torch.Tensor  # [B, Q]
    positions: torch.Tensor  # [B, Q]
    write_rows: torch.Tensor  # [N] indices into the flattened [B*Q] tokens that are real
    write_slots: torch.Tensor  # [N] cache slots those tokens fill
    gather_slots: torch.Tensor  # [B, C] cache slot of context position c of row b
    context_lens: torch.Tensor  # [B]
    logits_index: torch.Tensor  # [B, n] query positions whose logits are wanted

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Q, C] True where query q may attend context position c."""
        cache = getattr(self, "_masks", None)
        if cache is None:
            cache = self._masks = {}
        if sliding_window not in cache:
            col = torch.arange(self.gather_slots.shape[1], device=self.positions.device)
            pos = self.positions[:, :, None]
            allowed = (col <= pos) & (col < self.context_lens[:, None, None])
            if sliding_window is not None:
                allowed &= col > pos - sliding_window
            cache[sliding_window] = allowed[:, None]
        return cache[sliding_window]


def build_paged_batch(token_rows: list[list[int]], start_positions: list[int],
                      block_tables: list[list[int]], block_size: int, num_logits: int,
                      device: torch.device) -> PagedBatch:
    """Lay out rows of new tokens (row b starts at position start_positions[b])."""
    B = len(token_rows)
    q_lens = [len(r) for r in token_rows]
    Q = max(q_lens)
    ctx = [s + n for s, n in zip(start_positions, q_lens)]
    input_ids = torch.zeros(B, Q, dtype=torch.long)
    positions = torch.zeros(B, Q, dtype=torch.long)
    rows, slots = [], []
    for b, (tokens, start, table) in enumerate(zip(token_rows, start_positions, block_tables)):
        n = len(tokens)
        input_ids[b, :n] = torch.tensor(tokens)
        positions[b, :n] = torch.arange(start, start + n)
        rows.extend(range(b * Q, b * Q + n))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.zeros(B, max_blocks, dtype=torch.long)
    for b, table in enumerate(block_tables):
        tables[b, :len(table)] = torch.tensor(table, dtype=torch.long)
    col = torch.arange(max(ctx))
    gather = tables[:, col // block_size] * block_size + col % block_size
    q_len_t = torch.tensor(q_lens)
    logits_index = (q_len_t[:, None] - num_logits + torch.arange(num_logits)).clamp(min=0)
    return PagedBatch(
        input_ids=input_ids.to(device), positions=positions.to(device),
        write_rows=torch.tensor(rows, dtype=torch.long, device=device),
        write_slots=torch.tensor(slots, dtype=torch.long, device=device),
        gather_slots=gather.to(device), context_lens=torch.tensor(ctx, device=device),
        logits_index=logits_index.to(device))
