"""RMSNorm of float32 rows on AVX-512 or AVX2 CPUs in one C call (rms_norm.c), built by native.py.

Hugging Face's formula took five elementwise ops, each a dispatch and a pass over the row: about
14 us a call on the shipped target's rows against ~4 us here (most of it the call itself), and a
decode step calls it twice a layer and once more. The sum of squares runs in another order than
torch's mean, so results may differ from the torch formula in the last bit (2e-7 relative here).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from vramledger.worker.kernels import native


@functools.cache
def _kernel():
    return native.function("rms_norm", "rms_norm", ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p)


def available() -> bool:
    return _kernel() is not None


def runs_on(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can normalize x with weight (float32 on a CPU that runs it, eager)."""
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _kernel()(rows.data_ptr(), rows.shape[0], rows.shape[1], weight.contiguous().data_ptr(), eps, out.data_ptr())
    return out.view(x.shape)
