"""One token per row drawn from softmax(logits / temperature) in one C call (draw_tokens.c), for float32
logits on AVX-512 or AVX2 CPUs: what engine/sampler.py's torch ops compute for rows that sample at a
temperature only, from the same uniforms (the last bits of the weights differ)."""
from __future__ import annotations

import ctypes
import functools

import torch

from vramledger.worker.kernels import native


@functools.cache
def _kernel():
    pointer = ctypes.c_void_p
    return native.function("draw_tokens", "draw_tokens", pointer, ctypes.c_int64, ctypes.c_int64, pointer,
                           pointer, pointer, pointer, returns_status=True)


def available() -> bool:
    return _kernel() is not None


def draw_tokens(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                probs: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] float32 CPU logits, [N] temperatures, [N] uniforms in [0, 1) -> [N] tokens; given `probs`
    (contiguous, the logits' shape), the probabilities they were drawn from too."""
    logits, u = logits.contiguous(), u.to(torch.float32).contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    _kernel()(logits.data_ptr(), logits.shape[0], logits.shape[1], temperature.data_ptr(), u.data_ptr(),
              tokens.data_ptr(), None if probs is None else probs.data_ptr())
    return tokens
