"""RoPE and the KV-cache write of one layer in one C call for float32 on the CPU (rotate_store.c).

A decode step rotated q and k with four elementwise ops and stored k and v with two index_copy_,
every layer: on the shipped target ~35 us a layer at 1 row and ~75 us at 32, against a few us
here. Built by native.py; where it cannot run, models/llama.py keeps rope.rotate_ and write_kv.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from vramledger.worker.kernels import native


@functools.cache
def _kernel():
    int64, pointer = ctypes.c_int64, ctypes.c_void_p
    return native.function("rotate_store", "rotate_store", pointer, int64, int64, int64, int64, pointer, pointer,
                           pointer, pointer, int64, pointer, pointer)


def available() -> bool:
    return _kernel() is not None


def runs_on(heads: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernel can take heads [B, Q, H + 2 kvH, D] into this cache (float32 CPU, dense, eager)."""
    return (heads.dtype == cache.dtype == torch.float32 and heads.device.type == "cpu" and heads.is_contiguous()
            and not torch.compiler.is_compiling() and available())


def rotate_store(heads: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Rotate the first num_heads + kvH heads of every token in place (cos, sin: [B, Q, 1, D/2]);
    store the keys and values of tokens `rows` of the flattened [B * Q] (None: all) at `slots` of
    keys and values [slots, kvH, D]."""
    B, Q, _, D = heads.shape
    cos, sin = (t.float().contiguous() for t in (cos, sin))
    slots = slots.to(torch.int64).contiguous()
    rows = None if rows is None else rows.to(torch.int64).contiguous()
    _kernel()(heads.data_ptr(), B * Q, num_heads, keys.shape[1], D, cos.data_ptr(), sin.data_ptr(),
              None if rows is None else rows.data_ptr(), slots.data_ptr(), slots.numel(), keys.data_ptr(),
              values.data_ptr())
