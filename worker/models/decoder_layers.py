"""Every decoder layer of a decode or verify step in one C call (decoder_layers.c), float32 on
AVX-512 or AVX2 CPUs with blocked weights (blocked_linear.py).

Layer by layer in torch a step made ~13 calls a layer, each a dispatch from Python and, for the C
kernels, a parallel region of its own: on the shipped target about 1.6 ms of an 11.7 ms step at
32 rows went to Python and small ops, and every region ends as late as its slowest thread, which
a client on the same cores preempts. Here one region runs every layer, its threads meeting at a
barrier between stages. A prompt's prefill (every row from position 0) keeps the layers in torch
(SDPA over its own tokens).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from worker.models import blocked_linear, native, paged_attention
from worker.models.attention import PagedBatch

WEIGHTS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
           "down_bias")


class Layer(ctypes.Structure):
    """decoder_layers.c's `struct layer`."""
    _fields_ = [*((name, ctypes.c_void_p) for name in WEIGHTS), ("window", ctypes.c_int64)]


@functools.cache
def _kernel():
    int64, pointer, single = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    return native.function("decoder_layers", "decoder_layers", pointer, int64, pointer, int64, int64, int64, int64,
                           int64, int64, int64, single, pointer, pointer, pointer, pointer, int64, pointer, pointer,
                           int64, pointer, pointer, pointer, int64, single, pointer, ctypes.c_int)


class DecoderLayers:
    """A model's layers laid out for the C call: the weights' addresses, taken once (the tensors are
    held here, so an address never outlives its tensor)."""

    def __init__(self, model):
        config = model.config
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden, self.inner = config.hidden_size, config.intermediate_size
        self.eps = model.model.layers[0].input_layernorm.eps
        self.tensors = []
        layers = []
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            weights = (layer.input_layernorm.weight, a.qkv_weight, a.qkv_bias, a.o_proj.weight, a.o_proj.bias,
                       layer.post_attention_layernorm.weight, mlp.gate_up_weight, mlp.gate_up_bias,
                       mlp.down_proj.weight, mlp.down_proj.bias)
            self.tensors += [w for w in weights if w is not None]
            layers.append(Layer(*(None if w is None else w.data_ptr() for w in weights), a.window or 0))
        self.layers = (Layer * len(layers))(*layers)

    @staticmethod
    def fits(model) -> bool:
        """Whether this model's layers can run in the kernel: float32 blocked weights, SiLU, and a
        head_dim paged attention takes."""
        weights = [getattr(m, name) for m, name, _ in model.projections()[:-1]]  # all but the head
        return (_kernel() is not None and model.config.hidden_act == "silu"
                and paged_attention.takes_head_dim(model.head_dim)
                and all(blocked_linear.is_blocked(w) and w.dtype == torch.float32 for w in weights))

    def runs_on(self, x: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> bool:
        """Whether this step can: not a prompt's prefill, float32 on the CPU, eager, dense x and cache,
        and a thread's attention scores within paged_attention's limit."""
        return (not batch.from_start and x.dtype == kv_cache.dtype == torch.float32 and x.device.type == "cpu"
                and x.is_contiguous() and kv_cache.is_contiguous() and not torch.compiler.is_compiling()
                and paged_attention.fits(batch.input_ids.shape[1], self.heads, batch.gather_slots.shape[1]))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 batch: PagedBatch) -> None:
        """Run every layer on x [B, Q, hidden] in place."""
        B, Q = batch.input_ids.shape
        M, D = B * Q, self.head_dim
        width = (self.heads + 2 * self.kv_heads) * D
        work = x.new_empty(M * (self.hidden + width + self.heads * D + 3 * self.inner))
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, positions, lengths, write_slots = (t.to(torch.int64).contiguous() for t in (
            batch.gather_slots, batch.positions, batch.context_lens, batch.write_slots))
        rows = None if batch.write_rows is None else batch.write_rows.to(torch.int64).contiguous()
        _kernel()(self.layers, len(self.layers), x.data_ptr(), B, Q, self.hidden, self.heads, self.kv_heads, D,
                  self.inner, self.eps, cos.data_ptr(), sin.data_ptr(), None if rows is None else rows.data_ptr(),
                  write_slots.data_ptr(), write_slots.numel(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                  kv_cache[0, 0].numel(), slots.data_ptr(), positions.data_ptr(), lengths.data_ptr(),
                  slots.shape[1], paged_attention.scale(D), work.data_ptr(), torch.get_num_threads())
