"""A model laid out for the one-call forward of its steps (kernels/decoder_layers.py): which models and
steps it takes, and a step's call."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from vramledger.worker.config import usable_cores
from vramledger.worker.kernels import blocked_linear, decoder_layers, paged_attention, prefill_attention
from vramledger.worker.models.attention import PagedBatch

# Multiply-adds below which a step runs on one thread. Each layer's stages meet at ~10 barriers; a
# second thread woken at each one (OpenMP's passive waiting, cli.py) costs more than it takes on a
# small step: in a server at one stream, 1 row decoded on 2 threads took ~1.7x as long as on 1, while
# 8 rows at 1072 positions (~77 M) and prompt chunks gain from 2 (docs/engine.md).
ONE_THREAD_WORK = 48e6
CORES = usable_cores()


class DecoderForward:
    """A model's weights' addresses, taken once (the tensors are held here, so an address never
    outlives its tensor)."""

    def __init__(self, model):
        config = model.config
        attn = model.model.layers[0].self_attn
        self.dims = decoder_layers.Dims(config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        config.intermediate_size, model.model.layers[0].input_layernorm.eps)
        self.tensors = []
        layers = []
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            weights = (layer.input_layernorm.weight, a.qkv_weight, a.qkv_bias, a.o_proj.weight, a.o_proj.bias,
                       layer.post_attention_layernorm.weight, mlp.gate_up_weight, mlp.gate_up_bias,
                       mlp.down_proj.weight, mlp.down_proj.bias)
            self.tensors += [w for w in weights if w is not None]
            layers.append(decoder_layers.Layer(*(None if w is None else w.data_ptr() for w in weights),
                                               a.window or 0))
        self.layers = (decoder_layers.Layer * len(layers))(*layers)
        # A head that is not blocked (its rows not whole blocks of 16) is left to the caller.
        head = model.lm_head.weight
        self.has_head = blocked_linear.is_blocked(head)
        ends = (model.model.embed_tokens.weight, model.rotary.inv_freq, model.model.norm.weight, head)
        self.tensors += ends
        self.token_work, self.position_work = model.token_work()  # a step's size picks its threads
        self.token_work += head.numel() if self.has_head else 0
        self.ends = decoder_layers.Ends(ends[0].data_ptr(), ends[1].data_ptr(), model.rotary.scaling,
                                        ends[2].data_ptr(), head.data_ptr() if self.has_head else None,
                                        config.vocab_size)
        # Called as a call's kernel starts, where the kernel leaves a core free for what it starts (a
        # server's event loop): served on both of 2 cores with a client beside, that work beside every
        # kernel made 8 rows' decode steps wait for cores, 6.3 ms (1.9 waiting) against 4.0 without.
        self.on_launch: Callable[[], None] | None = None
        # A large step's threads while the engine runs a step of one prompt alone (None: torch's), set
        # by ModelRunner.prompt_alone.
        self.alone_threads: int | None = None

    @staticmethod
    def fits(model) -> bool:
        """Whether this model can run in the kernel: float32 blocked layer weights and embeddings, SiLU,
        and a head_dim paged attention takes."""
        weights = [getattr(m, name) for m, name, _ in model.projections()[:-1]]  # all but the head
        return (decoder_layers.available() and model.config.hidden_act == "silu"
                and paged_attention.takes_head_dim(model.head_dim)
                and model.model.embed_tokens.weight.dtype == torch.float32
                and all(blocked_linear.is_blocked(w) and w.dtype == torch.float32 for w in weights))

    def runs_on(self, kv_cache: torch.Tensor, batch: PagedBatch) -> bool:
        """Whether this step can: a dense float32 cache on the CPU, eager, and a thread's attention
        scores within the limit of the step's attention kernel (a prompt chunk's or a decode step's)."""
        context = batch.gather_slots.shape[1]
        fits = prefill_attention.fits(context) if batch.prefill else \
            paged_attention.fits(batch.input_ids.shape[1], self.dims.heads, context)
        return (fits and kv_cache.dtype == torch.float32 and kv_cache.device.type == "cpu"
                and kv_cache.is_contiguous() and not torch.compiler.is_compiling())

    def __call__(self, batch: PagedBatch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's output x [B, Q, hidden], and the logits [B, n, V] at batch.logits_index
        (None where the head is left to the caller)."""
        x, logits = self.forward_parts([batch], kv_cache)
        return x.view(*batch.input_ids.shape, -1), None if logits is None else logits[0]

    def forward_parts(self, batches: list[PagedBatch], kv_cache: torch.Tensor) -> tuple[torch.Tensor, list | None]:
        """One forward over the rows of several batches (a prompt's chunk and the rows decoding beside it):
        the last layer's output x [tokens, hidden], and each batch's logits (None: the caller's head)."""
        parts = [decoder_layers.Rows(b.input_ids, b.positions, b.gather_slots, b.context_lens, b.logits_index,
                                     b.prefill) for b in batches]
        if len(batches) == 1:
            write_rows, write_slots = batches[0].write_rows, batches[0].write_slots
        else:  # each batch's rows are numbered after the earlier batches' tokens
            firsts = itertools.accumulate((b.input_ids.numel() for b in batches), initial=0)
            write_rows = torch.cat([first + (torch.arange(b.input_ids.numel(), device=b.write_slots.device)
                                             if b.write_rows is None else b.write_rows)
                                    for b, first in zip(batches, firsts)])
            write_slots = torch.cat([b.write_slots for b in batches])
        threads = self.threads(batches)
        return decoder_layers.decoder_forward(self.layers, self.ends, self.dims, parts, write_slots, write_rows,
                                              kv_cache[0], kv_cache[1], threads,
                                              self.on_launch if threads < CORES else None)

    def threads(self, batches: list[PagedBatch]) -> int:
        """One thread for a small step, else torch's, or a step of one prompt alone's: by the step's
        multiply-adds, each token over the widest row's context."""
        work = sum(b.input_ids.numel() * (self.token_work + self.position_work * b.gather_slots.shape[1])
                   for b in batches)
        return 1 if work < ONE_THREAD_WORK else self.alone_threads or torch.get_num_threads()
