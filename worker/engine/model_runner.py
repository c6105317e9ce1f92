"""Target and draft models, their KV caches, and one batched forward over block tables."""
from __future__ import annotations

import torch

from worker.models.attention import BlockTables, GatherWorkspace, build_paged_batch
from worker.models.llama import CausalLM
from worker.models.packed_linear import warm


class ModelRunner:
    """Runs either model over rows of new tokens; both share one block table per request."""

    def __init__(self, target: CausalLM, draft: CausalLM | None, block_size: int, device: torch.device):
        self.models = {"target": target} if draft is None else {"target": target, "draft": draft}
        self.block_size = block_size
        self.device = device
        self.kv: dict[str, torch.Tensor] = {}
        self.workspace = GatherWorkspace()

    def bytes_per_block(self, name: str | None = None) -> int:
        """KV bytes one block holds for one model, or for all of them."""
        names = [name] if name else list(self.models)
        total = 0
        for n in names:
            model = self.models[n]
            elem = next(model.parameters()).element_size()
            total += elem * torch.Size(model.kv_cache_shape(self.block_size)).numel()
        return total

    def warm_kernels(self) -> None:
        """Build every matmul kernel a forward can ask for (packed_linear.py; none off the CPU)."""
        for model in self.models.values():
            warm([(getattr(m, w), getattr(m, b) if b else None) for m, w, b in model.projections()])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        num_slots = num_blocks * self.block_size
        for name, model in self.models.items():
            dtype = next(model.parameters()).dtype
            self.kv[name] = torch.zeros(model.kv_cache_shape(num_slots), dtype=dtype, device=self.device)

    def block_tables(self, tables: list[list[int]]) -> BlockTables:
        """Tables as tensors, once per step: its draft and target forwards share them."""
        return BlockTables.build(tables, self.block_size, self.device)

    @torch.inference_mode()
    def forward(self, name: str, token_rows: list[list[int]], starts: list[int],
                block_tables: list[list[int]] | BlockTables, num_logits: int,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, num_logits, V] at the last positions of each row.

        `input_ids` [B, Q] replaces the rows' tokens when they already live on the device
        (draft proposals), so no host round trip is needed to feed them back.
        """
        batch = build_paged_batch(token_rows, starts, block_tables, self.block_size, num_logits, self.device)
        batch.workspace = self.workspace
        if input_ids is not None:
            batch.input_ids = input_ids
        return self.models[name](batch, self.kv[name])
