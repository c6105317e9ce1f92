"""A decode or verify step's whole forward in one C call (decoder_layers.c), float32 on AVX-512 or
AVX2 CPUs with blocked weights (blocked_linear.py): the embeddings and RoPE angles, every layer, the
final norm and the head.

Layer by layer in torch a step made ~13 calls a layer, each a dispatch from Python and, for the C
kernels, a parallel region of its own: on the shipped target about 1.6 ms of an 11.7 ms step at
32 rows went to Python and small ops, and every region ends as late as its slowest thread, which
a client on the same cores preempts. Here one region runs the forward, its threads meeting at a
barrier between stages. Around the layers, the embedding, RoPE's cos and sin, the gather of the
rows with logits, the final norm and the head were ~10 more ops: 0.33 ms of the draft's 0.55 ms
forward at 4 rows, 0.5 ms of the target's. A prompt's prefill (every row from position 0) keeps
torch (SDPA over its own tokens).
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


class Ends(ctypes.Structure):
    """decoder_layers.c's `struct ends`."""
    _fields_ = [("embed", ctypes.c_void_p), ("inv_freq", ctypes.c_void_p), ("rope_scaling", ctypes.c_float),
                ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p), ("vocab", ctypes.c_int64)]


@functools.cache
def _kernel():
    int64, pointer, single = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    return native.function("decoder_layers", "decoder_forward", pointer, int64, pointer, pointer, pointer, int64,
                           int64, int64, int64, int64, int64, int64, single, pointer, pointer, int64, pointer,
                           pointer, int64, pointer, pointer, pointer, int64, single, pointer, int64, pointer,
                           pointer, ctypes.c_int)


class DecoderForward:
    """A model laid out for the C call: the weights' addresses, taken once (the tensors are held
    here, so an address never outlives its tensor)."""

    def __init__(self, model):
        config = model.config
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden, self.inner, self.vocab = config.hidden_size, config.intermediate_size, config.vocab_size
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
        # A head that is not blocked (its rows not whole blocks of 16) is left to the caller.
        head = model.lm_head.weight
        self.has_head = blocked_linear.is_blocked(head)
        ends = (model.model.embed_tokens.weight, model.rotary.inv_freq, model.model.norm.weight, head)
        self.tensors += ends
        self.ends = Ends(ends[0].data_ptr(), ends[1].data_ptr(), model.rotary.scaling, ends[2].data_ptr(),
                         head.data_ptr() if self.has_head else None, self.vocab)

    @staticmethod
    def fits(model) -> bool:
        """Whether this model can run in the kernel: float32 blocked layer weights and embeddings, SiLU,
        and a head_dim paged attention takes."""
        weights = [getattr(m, name) for m, name, _ in model.projections()[:-1]]  # all but the head
        return (_kernel() is not None and model.config.hidden_act == "silu"
                and paged_attention.takes_head_dim(model.head_dim)
                and model.model.embed_tokens.weight.dtype == torch.float32
                and all(blocked_linear.is_blocked(w) and w.dtype == torch.float32 for w in weights))

    def runs_on(self, kv_cache: torch.Tensor, batch: PagedBatch) -> bool:
        """Whether this step can: not a prompt's prefill, a dense float32 cache on the CPU, eager, and a
        thread's attention scores within paged_attention's limit."""
        return (not batch.from_start and kv_cache.dtype == torch.float32 and kv_cache.device.type == "cpu"
                and kv_cache.is_contiguous() and not torch.compiler.is_compiling()
                and paged_attention.fits(batch.input_ids.shape[1], self.heads, batch.gather_slots.shape[1]))

    def __call__(self, batch: PagedBatch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last layer's output x [B, Q, hidden], and the logits [B, n, V] at batch.logits_index
        (None where the head is left to the caller)."""
        B, Q = batch.input_ids.shape
        n, M, D = batch.logits_index.shape[1], B * Q, self.head_dim
        floats = dict(dtype=torch.float32, device=kv_cache.device)
        x = torch.empty(B, Q, self.hidden, **floats)
        logits = torch.empty(B, n, self.vocab, **floats) if self.has_head else None
        work = torch.empty(M * (2 * self.hidden + (2 * self.heads + 2 * self.kv_heads + 1) * D + 3 * self.inner),
                           **floats)
        ids, slots, positions, lengths, write_slots, index = (t.to(torch.int64).contiguous() for t in (
            batch.input_ids, batch.gather_slots, batch.positions, batch.context_lens, batch.write_slots,
            batch.logits_index))
        rows = None if batch.write_rows is None else batch.write_rows.to(torch.int64).contiguous()
        _kernel()(self.layers, len(self.layers), ctypes.byref(self.ends), ids.data_ptr(), x.data_ptr(), B, Q,
                  self.hidden, self.heads, self.kv_heads, D, self.inner, self.eps,
                  None if rows is None else rows.data_ptr(), write_slots.data_ptr(), write_slots.numel(),
                  kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_cache[0, 0].numel(), slots.data_ptr(),
                  positions.data_ptr(), lengths.data_ptr(), slots.shape[1], paged_attention.scale(D),
                  index.data_ptr(), n, None if logits is None else logits.data_ptr(), work.data_ptr(),
                  torch.get_num_threads())
        return x, logits
