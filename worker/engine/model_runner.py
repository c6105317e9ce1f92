"""Target and draft models, their KV caches, and one batched forward over block tables."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from vramledger.worker.kernels import paged_attention, prefill_attention
from vramledger.worker.models.attention import BlockTables, GatherWorkspace, PagedBatch, build_paged_batch
from vramledger.worker.models.compiled import compile_model, shape_classes
from vramledger.worker.models.llama import CausalLM
from vramledger.worker.models.packed_linear import warm


class ModelRunner:
    """Runs either model over rows of new tokens; both share one block table per request."""

    def __init__(self, target: CausalLM, draft: CausalLM | None, block_size: int, device: torch.device):
        self.models = {"target": target} if draft is None else {"target": target, "draft": draft}
        self.block_size = block_size
        self.device = device
        self.kv: dict[str, torch.Tensor] = {}
        self.workspace = GatherWorkspace()
        self.run = dict(self.models)  # what forward() calls per model: the model, or it compiled
        self.prompt_threads: int | None = None  # those of a step of one prompt alone; None: torch's

    def on_compute(self, hook: Callable[[], None]) -> None:
        """hook() is called as a forward's one-call kernel starts, its inputs built and the GIL about to
        be released, where the kernel leaves a core free (the CPU's; other forwards never call it): a
        server hands the previous step's outputs to its event loop there, whose work on them then
        overlaps the kernel (EngineLoop)."""
        for model in self.models.values():
            if model.fused_forward is not None:
                model.fused_forward.on_launch = hook

    @contextmanager
    def prompt_alone(self) -> Iterator[None]:
        """The forwards of a step of one prompt alone (no other request in it) run on prompt_threads
        where the one-call forward takes them (the CPU's): its client waits for its first token and no
        stream's tokens go out beside it, so the core the other steps leave to the server's threads and
        a client (cli.py) would sit idle."""
        fused = [model.fused_forward for model in self.models.values() if model.fused_forward is not None]
        for forward in fused:
            forward.alone_threads = self.prompt_threads
        try:
            yield
        finally:
            for forward in fused:
                forward.alone_threads = None

    def bytes_per_block(self, name: str | None = None) -> int:
        """KV bytes one block holds for one model, or for all of them."""
        names = [name] if name else list(self.models)
        total = 0
        for n in names:
            model = self.models[n]
            elem = next(model.parameters()).element_size()
            total += elem * torch.Size(model.kv_cache_shape(self.block_size)).numel()
        return total

    def attention_span(self) -> float:
        """Context positions one token's attention reads for as many multiply-adds as its matmuls
        in the target's layers (token_work)."""
        matmuls, attention = self.models["target"].token_work()
        return matmuls / attention

    def narrowest_gathered_chunk(self, context: int) -> int:
        """The fewest new tokens a prompt's chunk over `context` positions has when some model's
        attention gathers its context: none where the prefill kernel reads it in place (context + 1),
        else where the decode kernel would need more scratch."""
        if all(self._reads_prompts_in_place(name, context) for name in self.models):
            return context + 1
        heads = max(m.model.layers[0].self_attn.num_heads for m in self.models.values())
        return next((w for w in range(1, context + 1) if not paged_attention.fits(w, heads, context)),
                    context + 1)

    def _reads_prompts_in_place(self, name: str, context: int) -> bool:
        """Whether this model's prompt chunks attend over the cache where it sits (the prefill kernel)."""
        model = self.models[name]
        probe = torch.empty(0, 0, 0, model.head_dim, dtype=next(model.parameters()).dtype, device=self.device)
        return self.run[name] is model and prefill_attention.runs_on(probe, probe, context)

    def warm_kernels(self) -> None:
        """Build every matmul kernel a forward can ask for (packed_linear.py; none off the CPU)."""
        for model in self.models.values():
            warm([(getattr(m, w), getattr(m, b) if b else None) for m, w, b in model.projections()])

    def compile(self, backend: str = "inductor") -> None:
        """Compile every model and build each kind of graph a step may need (shape_classes), on a
        scratch cache; afterwards a step never compiles: a shape no graph fits runs eagerly."""
        torch.compiler.set_stance("default")  # compiles again, should an earlier engine have frozen it
        self.run = {name: compile_model(model, backend) for name, model in self.models.items()}
        # Logits per row: one, or (the target's verify) one per new token: 3 stands for any k + 1.
        logits = {"target": (1, 3) if "draft" in self.models else (1,), "draft": (1,)}
        self.allocate_kv_cache(1)  # the warm-up rows reach position 7 of one block
        for name in self.models:
            for rows, starts, n in shape_classes(logits[name]):
                self.forward(name, rows, starts, [[0]] * len(rows), n)
        self.kv.clear()
        torch.compiler.set_stance("eager_on_recompile")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        num_slots = num_blocks * self.block_size
        for name, model in self.models.items():
            dtype = next(model.parameters()).dtype
            self.kv[name] = torch.zeros(model.kv_cache_shape(num_slots), dtype=dtype, device=self.device)

    @torch.inference_mode()  # as forward() builds them: compiled graphs are guarded on the kind of tensor
    def block_tables(self, tables: list[list[int]]) -> BlockTables:
        """Tables as tensors, once per step: its draft and target forwards share them."""
        return BlockTables.build(tables, self.block_size, self.device)

    @torch.inference_mode()
    def forward(self, name: str, token_rows: list[list[int]], starts: list[int],
                block_tables: list[list[int]] | BlockTables, num_logits: int,
                input_ids: torch.Tensor | None = None, prefill: bool = False) -> torch.Tensor:
        """Logits [B, num_logits, V] at the last positions of each row.

        `input_ids` [B, Q] replaces the rows' tokens when they already live on the device
        (draft proposals), so no host round trip is needed to feed them back. `prefill`: the rows
        are chunks of prompts (their attention is the prefill kernel's), not generated tokens.
        """
        compiled = self.run[name] is not self.models[name]
        # Compiled, no logits and unpadded rows would each be graphs of their own: one logit at least
        # (dropped below) and every row's tokens written by index make one graph serve them all.
        n = max(1, num_logits) if compiled else num_logits
        if input_ids is not None and compiled and not input_ids.is_inference():
            input_ids = input_ids.clone()  # compiled graphs are guarded on inference tensors, as batches' are
        batch = self._paged_batch(name, token_rows, starts, block_tables, n, input_ids, prefill)
        if compiled and batch.write_rows is None:
            batch.write_rows = torch.arange(batch.write_slots.numel(), device=self.device)
        logits = self.run[name](batch, self.kv[name])
        return logits[:, :num_logits] if compiled else logits

    def _paged_batch(self, name: str, token_rows: list[list[int]], starts: list[int],
                     block_tables: list[list[int]] | BlockTables, num_logits: int,
                     input_ids: torch.Tensor | None = None, prefill: bool = False) -> PagedBatch:
        """The rows laid out for `name`'s forward; an eager one gathers into the runner's workspace."""
        batch = build_paged_batch(token_rows, starts, block_tables, self.block_size, num_logits, self.device,
                                  input_ids, prefill)
        if self.run[name] is self.models[name]:  # a compiled forward's buffers are its own (inductor plans them)
            batch.workspace = self.workspace
        return batch

    @torch.inference_mode()
    def forward_parts(self, name: str, parts: list[tuple]) -> list[torch.Tensor]:
        """forward() of each part, (token_rows, starts, block_tables, num_logits, prefill): a prompt's
        chunks and the rows decoding beside them. One forward where the model's one-call forward takes
        them all (the CPU's), which reads the weights once for every row; else one a part."""
        model = self.models[name]
        if len(parts) < 2 or self.run[name] is not model:
            return [self.forward(name, rows, starts, tables, n, prefill=prefill)
                    for rows, starts, tables, n, prefill in parts]
        batches = [self._paged_batch(name, rows, starts, tables, n, prefill=prefill)
                   for rows, starts, tables, n, prefill in parts]
        return model.forward_parts(batches, self.kv[name])
