"""Draft proposals verified from the target's logits in one C call (verify_tokens.c), for float32 logits
on AVX-512 or AVX2 CPUs: what engine/spec_decode.py's torch path computes for rows that sample at a
temperature only, from the same uniforms (the last bits of the probabilities differ)."""
from __future__ import annotations

import ctypes
import functools

import torch

from vramledger.worker.kernels import native


@functools.cache
def _kernel():
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    return native.function("verify_tokens", "verify_tokens", pointer, pointer, pointer, int64, int64, int64,
                           pointer, pointer, pointer, pointer, pointer, returns_status=True)


def available() -> bool:
    return _kernel() is not None


def verify_tokens(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, logits: torch.Tensor,
                  temperature: torch.Tensor, u_accept: torch.Tensor, u_next: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, k], the draft's probabilities q [B, k, V], the target's float32 CPU logits
    [B, k+1, V], temperatures [B], uniforms u_accept [B, k] and u_next [B] -> (num_accepted [B],
    tokens [B, k+1]), of which row b emits tokens[b, :num_accepted[b] + 1]."""
    B, k = draft_tokens.shape
    draft_tokens, draft_probs, logits = (t.contiguous() for t in (draft_tokens, draft_probs, logits))
    temperature, u_accept, u_next = (t.float().contiguous() for t in (temperature, u_accept, u_next))
    num_accepted, tokens = torch.empty(B, dtype=torch.int64), torch.empty(B, k + 1, dtype=torch.int64)
    _kernel()(draft_tokens.data_ptr(), draft_probs.data_ptr(), logits.data_ptr(), B, k, logits.shape[-1],
              temperature.data_ptr(), u_accept.data_ptr(), u_next.data_ptr(), num_accepted.data_ptr(),
              tokens.data_ptr())
    return num_accepted, tokens

