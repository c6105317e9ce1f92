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

import functools

import torch

from vramledger.worker.kernels import paged_attention

MAX_SCRATCH = 16 << 20  # bytes of scores a thread holds for one tile (prefill_attention.h)
TILE_ROWS = 32  # the most query rows a tile holds (16 on AVX2 builds): what sizes a thread's scratch


@functools.cache
def _kernel():
    return paged_attention.load("prefill_attention")


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
    return paged_attention.call(_kernel(), q, keys, values, slots, positions, lengths, window)
