"""The paged attention kernel attends as the gather + mask + SDPA path does, reading the cache in place."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from vramledger.worker.kernels import native, paged_attention
from vramledger.worker.models.attention import build_paged_batch
from vramledger.worker.models.llama import read_context

needs_kernel = pytest.mark.skipif(not paged_attention.available(), reason="no AVX-512 or AVX2, or no C compiler here")
CPU = torch.device("cpu")
BLOCK = 16


def torch_path(q, cache, batch, window):
    """What Attention.forward computes without the kernel: [B, Q, H * D]."""
    B, Q, H, D = q.shape
    kv_heads = cache.shape[2]
    buffers = [torch.empty(batch.gather_slots.numel(), kv_heads, D) for _ in range(2)]
    keys, values = (read_context(cache[i], batch.gather_slots, buffers[i]) for i in range(2))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=batch.mask(window, q.dtype),
                                         enable_gqa=H != kv_heads)
    return out.transpose(1, 2).reshape(B, Q, -1)


def example(heads, kv_heads, dim, seed=0):
    """Three rows over scattered blocks: 5, 3 and 1 new tokens after 40, 10 and 70 cached ones."""
    torch.manual_seed(seed)
    cache = torch.randn(2, 64 * BLOCK, kv_heads, dim)  # [k/v, slots, kvH, D]: one layer
    tables, starts, rows = [[5, 9, 2, 7], [1, 3], [11, 12, 13, 14, 15]], [40, 10, 70], [[1] * 5, [1] * 3, [1]]
    batch = build_paged_batch(rows, starts, tables, BLOCK, 1, CPU)
    # q as the model holds it: a view into the fused q/k/v projection's output
    q = torch.randn(3, 5, heads + 2 * kv_heads, dim)[:, :, :heads]
    return q, cache, batch


def run_kernel(q, cache, batch, window):
    return paged_attention.attend(q, cache[0], cache[1], batch.gather_slots, batch.positions, batch.context_lens,
                                  window)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 32), (4, 4, 64), (16, 1, 16), (4, 2, 128), (4, 2, 48)])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_the_gather_mask_and_sdpa_path(heads, kv_heads, dim, window):
    q, cache, batch = example(heads, kv_heads, dim)
    torch.testing.assert_close(run_kernel(q, cache, batch, window), torch_path(q, cache, batch, window),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_a_batch():
    q, cache, batch = example(8, 4, 32)
    together = run_kernel(q, cache, batch, None)
    alone = build_paged_batch([[1] * 3], [10], [[1, 3]], BLOCK, 1, CPU)
    assert torch.equal(run_kernel(q[1:2, :3], cache, alone, None), together[1:2, :3])


@needs_kernel
def test_the_kernel_takes_what_it_can_compute_and_leaves_the_rest():
    q, cache, _ = example(8, 4, 32)
    assert paged_attention.runs_on(q, cache, 80)
    assert not paged_attention.runs_on(q.bfloat16(), cache.bfloat16(), 80)  # float32 only
    assert not paged_attention.runs_on(torch.zeros(1, 1, 8, 24), torch.zeros(2, 4, 4, 24), 80)  # head_dim 24
    assert not paged_attention.runs_on(torch.zeros(1, 1, 2, 256), torch.zeros(2, 4, 2, 256), 80)  # over 128
    # A long prompt over a sliding window would need its scores for every token at once: SDPA.
    assert paged_attention.runs_on(torch.zeros(1, 5, 32, 128), torch.zeros(2, 4, 8, 128), 8192)
    assert not paged_attention.runs_on(torch.zeros(1, 2048, 32, 128), torch.zeros(2, 4, 8, 128), 2048)


def test_the_kernel_loads_wherever_it_can_run():
    can_run = native.isa() is not None and shutil.which("cc")
    assert paged_attention.available() == bool(can_run)


@needs_kernel
@pytest.mark.parametrize("window", [None, 7])
def test_a_token_verified_among_a_drafts_gives_the_bits_it_gives_decoded_alone(window):
    """A token's bits depend on its own context only: token 2 of 5 new ones (at position 42)
    against the same token decoded with 42 cached before it (the gather and SDPA path differs)."""
    q, cache, _ = example(8, 4, 32)
    verify = build_paged_batch([[1] * 5], [40], [[5, 9, 2, 7]], BLOCK, 1, CPU)
    alone = build_paged_batch([[1]], [42], [[5, 9, 2, 7]], BLOCK, 1, CPU)
    together = run_kernel(q[:1], cache, verify, window)
    assert torch.equal(run_kernel(q[:1, 2:3].contiguous(), cache, alone, window), together[:, 2:3])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 32), (2, 2, 16), (16, 1, 16), (4, 2, 48), (16, 4, 128)])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_reading_one_prefix_give_the_bits_each_gives_alone(heads, kv_heads, dim, tokens, window, threads):
    """Rows whose tables share a prefix's blocks score them together, queries in vector lanes
    (query_lanes.h, on AVX-512); each row's bits are still those it gets alone, where its queries go
    through the sum trees (or lanes of its own, from 12 query heads a key/value head). 13 rows: 32
    shared positions, then rows of their own lengths over blocks of their own, two of them sharing
    those too."""
    torch.manual_seed(1)
    cache = torch.randn(2, 64 * BLOCK, kv_heads, dim)
    tables = [[5, 9, 20 + 3 * r, 21 + 3 * r, 22 + 3 * r] for r in range(13)]
    tables[4] = tables[3]
    starts = [32 + 3 * r for r in range(13)]
    starts[4] = starts[3]
    q = torch.randn(13, tokens, heads + 2 * kv_heads, dim)[:, :, :heads]
    batch = build_paged_batch([[1] * tokens] * 13, starts, tables, BLOCK, 1, CPU)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = run_kernel(q, cache, batch, window)
        torch.testing.assert_close(together, torch_path(q, cache, batch, window), rtol=1e-5, atol=1e-5)
        for r in range(13):
            alone = build_paged_batch([[1]], [starts[r] + tokens - 1], [tables[r]], BLOCK, 1, CPU)
            last = q[r:r + 1, tokens - 1:].contiguous()
            assert torch.equal(run_kernel(last, cache, alone, window), together[r:r + 1, tokens - 1:]), r
    finally:
        torch.set_num_threads(before)
