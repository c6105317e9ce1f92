"""The fused RoPE + KV write does what rotate_ and write_kv do, for every token and only the real ones."""
from __future__ import annotations

import shutil

import pytest
import torch

from vramledger.worker.kernels import native, rotate_store
from vramledger.worker.models.llama import real_tokens, write_kv
from vramledger.worker.models.rope import rotate_

needs_kernel = pytest.mark.skipif(not rotate_store.available(), reason="no AVX-512 or AVX2, or no C compiler here")


def example(padded: bool):
    """Two rows of 3 new tokens over heads [B, Q, H + 2 kvH, D] (H 4, kvH 2, D 16); padded: the
    second row has one real token (rows lists the real ones)."""
    torch.manual_seed(0)
    heads = torch.randn(2, 3, 8, 16)
    angles = torch.randn(2, 3, 1, 8)
    rows = torch.tensor([0, 1, 2, 3]) if padded else None
    slots = torch.tensor([9, 4, 17, 30]) if padded else torch.tensor([9, 4, 17, 30, 31, 2])
    return heads, angles.cos(), angles.sin(), rows, slots


@needs_kernel
@pytest.mark.parametrize("padded", [False, True])
def test_matches_rotate_and_write_kv(padded):
    heads, cos, sin, rows, slots = example(padded)
    expected_heads, expected_cache = heads.clone(), torch.randn(2, 1, 40, 2, 16)
    cache = expected_cache.clone()
    rotate_(expected_heads[:, :, :6], cos, sin)
    k, v = expected_heads[:, :, 4:6], expected_heads[:, :, 6:]
    write_kv(expected_cache, 0, slots, real_tokens(k, rows), real_tokens(v, rows))

    assert rotate_store.runs_on(heads, cache)
    rotate_store.rotate_store(heads, 4, cos, sin, cache[0, 0], cache[1, 0], slots, rows)
    torch.testing.assert_close(heads, expected_heads, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-6, atol=1e-6)  # other slots untouched too


@needs_kernel
def test_takes_only_what_it_can_write():
    heads, cache = torch.zeros(1, 1, 8, 16), torch.zeros(2, 1, 4, 2, 16)
    assert rotate_store.runs_on(heads, cache)
    assert not rotate_store.runs_on(heads.bfloat16(), cache.bfloat16())
    assert not rotate_store.runs_on(torch.zeros(1, 3, 8, 32)[..., :16], cache)  # not dense


def test_the_kernel_loads_wherever_it_can_run():
    can_run = native.isa() is not None and shutil.which("cc")
    assert rotate_store.available() == bool(can_run)
