"""Attention over the paged KV cache in one C call for float32 on AVX-512 or AVX2 CPUs (paged_attention.c).

The torch path gathers each layer's context out of the cache into [B, kvH, C, D] buffers, builds
an additive mask and runs SDPA: at 16 rows on the shipped target that was 35% of a decode step
(gather 1.4 ms, SDPA 1.7 of 8.8, one thread). The kernel reads each key and value where it sits,
through the rows' slot tables, and applies the causal and window limits as loop bounds. It takes
decode and verify steps alike (2-3.5x faster than gather + SDPA at both, bench/paged_attention.py);
a prompt's chunks go to prefill_attention.py, which shares this call's signature (load, call).
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch

from vramledger.worker.kernels import native

MAX_SCRATCH = 16 << 20  # bytes of scores a thread holds for one row (paged_attention.h)


def load(name: str):
    """An attention kernel of this signature (paged_attention.c, prefill_attention.c); None where absent."""
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    return native.function(name, name, pointer, int64, pointer, pointer, pointer, pointer, pointer, int64, int64,
                           int64, int64, int64, int64, int64, ctypes.c_float, pointer, ctypes.c_int, returns_status=True)


@functools.cache
def _kernel():
    return load("paged_attention")


def available() -> bool:
    return _kernel() is not None


def runs_on(q: torch.Tensor, cache: torch.Tensor, context: int) -> bool:
    """Whether the kernel can attend q [B, Q, H, D] over `context` positions of this cache (float32
    CPU, eager, D a multiple of 16 up to 128, and a thread's scores for one row within MAX_SCRATCH:
    a long prompt over a sliding window goes to SDPA)."""
    B, Q, H, D = q.shape
    return (q.dtype == cache.dtype == torch.float32 and q.device.type == "cpu" and takes_head_dim(D)
            and fits(Q, H, context) and not torch.compiler.is_compiling() and available())


def takes_head_dim(head_dim: int) -> bool:
    """Whole vectors of 16 floats, at most 8 of them (paged_attention.h's MAX_VECTORS)."""
    return head_dim % 16 == 0 and head_dim <= 128


def fits(queries: int, heads: int, context: int) -> bool:
    """Whether a thread's scores for one row (queries x heads over the context) fit MAX_SCRATCH."""
    return queries * heads * (context + 32) * 4 <= MAX_SCRATCH


def scale(head_dim: int) -> float:
    return 1 / math.sqrt(head_dim)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, lengths: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [B, Q, H, D] (tokens evenly strided, heads and dims dense); keys, values [slots, kvH, D];
    slots [B, C] the cache slot of each context position; positions [B, Q]; lengths [B].
    Returns [B, Q, H * D]."""
    return call(_kernel(), q, keys, values, slots, positions, lengths, window)


def call(kernel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
         positions: torch.Tensor, lengths: torch.Tensor, window: int | None) -> torch.Tensor:
    """Lays the tensors out as an attention kernel of load()'s signature reads them, and runs it."""
    B, Q, H, D = q.shape
    if q.stride(3) != 1 or q.stride(2) != D or q.stride(0) != Q * q.stride(1):
        q = q.contiguous()
    keys, values = keys.contiguous(), values.contiguous()
    slots, positions, lengths = (t.to(torch.int64).contiguous() for t in (slots, positions, lengths))
    out = q.new_empty(B, Q, H * D)
    kernel(q.data_ptr(), q.stride(1), keys.data_ptr(), values.data_ptr(), slots.data_ptr(),
              positions.data_ptr(), lengths.data_ptr(), B, Q, slots.shape[1], H, keys.shape[1], D,
              window or 0, scale(D), out.data_ptr(), torch.get_num_threads())
    return out
