"""float32 matmuls on AVX-512 and AVX2 CPUs through this project's own kernel (blocked_linear.c).

Weights are stored as [out / 16, in, 16]: blocks of 16 outputs, each read as one stream. Per pass
over the shipped target's 32 projections (bench/packed_linear.py, medians, this project's 2-core
AMD machine) against oneDNN over its packed weights: 1.77x faster at 1 row, 1.45x at 5, 1.25x at
16, 1.05x at 80 with one thread; 1.88x, 1.62x, 1.38x, 1.09x with two. A decode step's matmuls
are small: a 256 x 256 one at 1 row, weights in cache, took 18 us through oneDNN and 5 us here
(ctypes call included). Each row's result is the same at any batch size (the kernel sums over
`in` in order), so a token decoded alone and in a batch agree to the bit.

Built and loaded by native.py; where it cannot run (neither AVX-512 nor AVX2, no C compiler) `available()` is
False and models/packed_linear.py keeps weights with oneDNN.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from vramledger.worker.kernels import native

BLOCK = 16  # outputs a block holds: one AVX-512 register of float32 (two of AVX2)


@functools.cache
def _kernel():
    return native.function("blocked_linear", "blocked_linear", ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int)


def available() -> bool:
    return _kernel() is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether this weight [out, in] can be blocked (float32 on the CPU, whole blocks of outputs)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[0] % BLOCK == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, in, 16]."""
    out_features, in_features = weight.shape
    return weight.detach().view(out_features // BLOCK, BLOCK, in_features).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[out / 16, in, 16] -> [out, in]."""
    blocks, in_features, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, in_features)


def is_blocked(weight: torch.Tensor) -> bool:
    return weight.dim() == 3 and weight.shape[-1] == BLOCK and not weight.is_mkldnn


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, unpack(packed), bias)."""
    blocks, in_features, _ = packed.shape
    rows = x.reshape(-1, in_features).contiguous()
    if rows.dtype != torch.float32:  # the kernel reads raw memory: any other dtype would be garbage
        raise TypeError(f"blocked_linear needs float32 inputs, got {rows.dtype}")
    out = rows.new_empty(rows.shape[0], blocks * BLOCK)
    _kernel()(rows.data_ptr(), rows.shape[0], in_features, packed.data_ptr(), out.shape[1], out.data_ptr(),
              torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out.shape[1])
