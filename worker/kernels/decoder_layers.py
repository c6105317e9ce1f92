"""A step's whole forward in one C call (decoder_layers.c), float32 on AVX-512 or AVX2 CPUs with
blocked weights (blocked_linear.py): the embeddings and RoPE angles, every layer, the final norm and
the head. A step's rows come in parts, one per attention kind: decode or verify rows, prompts' chunks,
or chunks with the rows decoding beside them. models/decoder_forward.py lays a model out for it.

Layer by layer in torch a step made ~13 calls a layer, each a dispatch from Python and, for the C
kernels, a parallel region of its own: on the shipped target about 1.6 ms of an 11.7 ms step at
32 rows went to Python and small ops, and every region ends as late as its slowest thread, which
a client on the same cores preempts. Here one region runs the forward, its threads meeting at a
barrier between stages. Around the layers, the embedding, RoPE's cos and sin, the gather of the
rows with logits, the final norm and the head were ~10 more ops: 0.33 ms of the draft's 0.55 ms
forward at 4 rows, 0.5 ms of the target's.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vramledger.worker.kernels import native, paged_attention

WEIGHTS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
           "down_bias")


class Layer(ctypes.Structure):
    """decoder_layers.c's `struct layer`: one layer's weight addresses (a bias may be None)."""
    _fields_ = [*((name, ctypes.c_void_p) for name in WEIGHTS), ("window", ctypes.c_int64)]


class Ends(ctypes.Structure):
    """decoder_layers.c's `struct ends`: the model around its layers (head None: the caller's)."""
    _fields_ = [("embed", ctypes.c_void_p), ("inv_freq", ctypes.c_void_p), ("rope_scaling", ctypes.c_float),
                ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p), ("vocab", ctypes.c_int64)]


@dataclass(frozen=True)
class Dims:
    """The model's sizes the call takes besides its weights."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    eps: float


class Part(ctypes.Structure):
    """decoder_layers.c's `struct part`: rows of one attention kind, their tokens after the earlier parts'."""
    _fields_ = [("slots", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("lengths", ctypes.c_void_p),
                ("logits_index", ctypes.c_void_p), ("B", ctypes.c_int64), ("Q", ctypes.c_int64),
                ("C", ctypes.c_int64), ("n", ctypes.c_int64), ("prefill", ctypes.c_int)]


@dataclass
class Rows:
    """One part of a forward: ids, positions [B, Q]; slots [B, C] the cache slot of each context position;
    lengths [B]; logits_index [B, n] the tokens whose logits are wanted; prefill: the tokens are prompts'
    (their chunks' attention kernel), else generated ones (decode and verify)."""
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    logits_index: torch.Tensor
    prefill: bool


@functools.cache
def _kernel():
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    return native.function("decoder_layers", "decoder_forward", pointer, int64, pointer, pointer, pointer, pointer,
                           int64, int64, int64, int64, int64, int64, ctypes.c_float, pointer, pointer, int64,
                           pointer, pointer, int64, pointer, int64, ctypes.c_float, pointer, pointer, ctypes.c_int,
                           returns_status=True)


def available() -> bool:
    return _kernel() is not None


def decoder_forward(layers: ctypes.Array[Layer], ends: Ends, dims: Dims, parts: list[Rows],
                    write_slots: torch.Tensor, write_rows: torch.Tensor | None, keys: torch.Tensor,
                    values: torch.Tensor, threads: int | None = None,
                    launching: Callable[[], None] | None = None) -> tuple[torch.Tensor, list | None]:
    """parts: the step's rows, a part per attention kind, their tokens one part after the other (M in
    all); write_slots [w] where tokens write_rows [w] of those M (None: the first w) store their keys
    and values; keys, values [layers, slots, kvH, D], dense; threads: the call's (None: torch's);
    launching: called once the inputs are built, just before the kernel (which holds no GIL) starts.
    Returns the last layer's output x [M, hidden] and each part's logits [B, n, vocab] at its
    logits_index (None where ends.head is None)."""
    D, f32, device = dims.head_dim, torch.float32, keys.device
    flat = [(p.ids.reshape(-1), p.positions.reshape(-1)) for p in parts]
    ids, positions = ((column[0] if len(parts) == 1 else torch.cat(column)).to(torch.int64).contiguous()
                      for column in zip(*flat))
    M = ids.numel()
    held = [(p.slots.to(torch.int64).contiguous(), p.lengths.to(torch.int64).contiguous(),
             p.logits_index.to(torch.int64).contiguous()) for p in parts]
    firsts = itertools.accumulate((p.ids.numel() for p in parts), initial=0)  # each part's first token
    structs = (Part * len(parts))(*(
        Part(slots.data_ptr(), positions[first:].data_ptr(), lengths.data_ptr(), index.data_ptr(), *p.ids.shape,
             slots.shape[1], index.shape[1], int(p.prefill))
        for p, first, (slots, lengths, index) in zip(parts, firsts, held)))
    x = torch.empty(M, dims.hidden, dtype=f32, device=device)
    wanted = [p.ids.shape[0] * p.logits_index.shape[1] for p in parts]
    logits = torch.empty(sum(wanted), ends.vocab, dtype=f32, device=device) if ends.head is not None else None
    work = torch.empty(M * (2 * dims.hidden + (2 * dims.heads + 2 * dims.kv_heads + 1) * D + 3 * dims.inner),
                       dtype=f32, device=device)
    write_slots = write_slots.to(torch.int64).contiguous()
    rows = None if write_rows is None else write_rows.to(torch.int64).contiguous()
    if launching is not None:
        launching()
    _kernel()(layers, len(layers), ctypes.byref(ends), ids.data_ptr(), positions.data_ptr(), x.data_ptr(), M,
              dims.hidden, dims.heads, dims.kv_heads, D, dims.inner, dims.eps,
              None if rows is None else rows.data_ptr(), write_slots.data_ptr(), write_slots.numel(),
              keys.data_ptr(), values.data_ptr(), keys[0].numel(), structs, len(parts), paged_attention.scale(D),
              None if logits is None else logits.data_ptr(), work.data_ptr(), threads or torch.get_num_threads())
    if logits is None:
        return x, None
    return x, [part.view(p.ids.shape[0], p.logits_index.shape[1], ends.vocab)
               for p, part in zip(parts, logits.split(wanted))]
