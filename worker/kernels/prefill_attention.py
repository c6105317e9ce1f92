"""Attention of a prompt's chunk over the paged KV cache in one C call, float32 on AVX-512 or AVX2 CPUs
(prefill_attention.c).

The decode kernel (paged_attention.py) sums each score in a tree of its own, which suits a few tokens
a row; a prefill chunk has hundreds, and its scores and weighted values are two matmuls. Torch did
them by gathering the context out of the cache, building a [B, Q, C] mask and running SDPA; this
kernel tiles the queries of a key/value head into vector lanes and reads the keys and values in place,
the causal and window limits as lane masks. Each token's bits depend on its own context only, so a
prompt prefilled whole, in chunks or after a cached prefix gives the same keys, values and logits.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from worker.kernels import native, paged_attention

MAX_SCRATCH = 16 << 20  # bytes of scores a thread holds for one tile (prefill_attention.h)
TILE_ROWS = 32  # the most query rows a tile holds (16 on AVX2 builds): what sizes a thread's scratch


@functools.cache
def _kernel():
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    return native.function("prefill_attention", "prefill_attention", pointer, int64, pointer, pointer, pointer,
                           pointer, pointer, int64, int64, int64, int64, int64, int64, int64, ctypes.c_float,
                           pointer, ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def fits(context: int) -> bool:
    """Whether a thread's scores for one tile over `context` positions fit MAX_SCRATCH."""
    return (context + 16) * TILE_ROWS * 4 <= MAX_SCRATCH


def runs_on(q: torch.Tensor, cache: torch.Tensor, context: int) -> bool:
    """Whether the kernel can attend q [B, Q, H, D] over `context` positions of this cache (float32 CPU,
    eager, D a multiple of 16 up to 128)."""
    return (not torch.compiler.is_compiling() and q.dtype == cache.dtype == torch.float32
            and q.device.type == "cpu" and paged_attention.takes_head_dim(q.shape[-1]) and fits(context)
            and available())


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, lengths: torch.Tensor, window: int | None) -> torch.Tensor:
    """As paged_attention.attend: q [B, Q, H, D] (tokens evenly strided, heads and dims dense); keys,
    values [slots, kvH, D]; slots [B, C]; positions [B, Q]; lengths [B]. Returns [B, Q, H * D]."""
    B, Q, H, D = q.shape
    if q.stride(3) != 1 or q.stride(2) != D or q.stride(0) != Q * q.stride(1):
        q = q.contiguous()
    keys, values = keys.contiguous(), values.contiguous()
    slots, positions, lengths = (t.to(torch.int64).contiguous() for t in (slots, positions, lengths))
    out = q.new_empty(B, Q, H * D)
    _kernel()(q.data_ptr(), q.stride(1), keys.data_ptr(), values.data_ptr(), slots.data_ptr(),
              positions.data_ptr(), lengths.data_ptr(), B, Q, slots.shape[1], H, keys.shape[1], D,
              window or 0, paged_attention.scale(D), out.data_ptr(), torch.get_num_threads())
    return out
