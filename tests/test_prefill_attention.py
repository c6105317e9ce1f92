"""The prefill attention kernel attends as the gather + mask + SDPA path does, reading the cache in place,
and a token's bits depend on its own context only."""
from __future__ import annotations

import pytest
import torch
from test_paged_attention import torch_path

from vramledger.worker.kernels import prefill_attention
from vramledger.worker.models.attention import build_paged_batch

needs_kernel = pytest.mark.skipif(not prefill_attention.available(), reason="no AVX-512 or AVX2, or no C compiler here")
CPU = torch.device("cpu")
BLOCK = 16
TABLES = [[5, 9, 2, 7, 20, 21], [1, 3, 4, 6], [11, 12, 13, 14, 15, 16]]


def example(heads, kv_heads, dim, seed=0):
    """Three prompt chunks over scattered blocks: 37, 20 and 3 new tokens after 0, 25 and 60 cached
    ones (each row's query heads fill several tiles)."""
    torch.manual_seed(seed)
    cache = torch.randn(2, 32 * BLOCK, kv_heads, dim)  # [k/v, slots, kvH, D]: one layer
    batch = build_paged_batch([[1] * 37, [1] * 20, [1] * 3], [0, 25, 60], TABLES, BLOCK, 1, CPU, prefill=True)
    # q as the model holds it: a view into the fused q/k/v projection's output
    q = torch.randn(3, 37, heads + 2 * kv_heads, dim)[:, :, :heads]
    return q, cache, batch


def run_kernel(q, cache, batch, window):
    return prefill_attention.attend(q, cache[0], cache[1], batch.gather_slots, batch.positions,
                                    batch.context_lens, window)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 32), (4, 4, 64), (16, 1, 16), (4, 2, 128), (4, 2, 48),
                                                (14, 2, 64)])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_the_gather_mask_and_sdpa_path(heads, kv_heads, dim, window):
    q, cache, batch = example(heads, kv_heads, dim)
    real = torch.tensor([[1] * n + [0] * (37 - n) for n in (37, 20, 3)], dtype=torch.bool)  # padding: never read
    torch.testing.assert_close(run_kernel(q, cache, batch, window)[real], torch_path(q, cache, batch, window)[real],
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 7])
def test_a_token_gives_the_same_bits_alone_in_a_batch_and_in_any_chunk(window):
    q, cache, batch = example(8, 4, 32)
    together = run_kernel(q, cache, batch, window)
    alone = build_paged_batch([[1] * 20], [25], TABLES[1:2], BLOCK, 1, CPU, prefill=True)
    assert torch.equal(run_kernel(q[1:2, :20], cache, alone, window), together[1:2, :20])
    # the last 12 of row 0's 37 tokens as a chunk of their own, after 25 cached
    chunk = build_paged_batch([[1] * 12], [25], TABLES[:1], BLOCK, 1, CPU, prefill=True)
    assert torch.equal(run_kernel(q[:1, 25:].contiguous(), cache, chunk, window), together[:1, 25:])


@needs_kernel
def test_one_thread_and_two_give_the_same_bits():
    q, cache, batch = example(4, 2, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(q, cache, batch, None)
        torch.set_num_threads(2)
        two = run_kernel(q, cache, batch, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_the_kernel_takes_what_it_can_compute_and_leaves_the_rest():
    q, cache, _ = example(8, 4, 32)
    assert prefill_attention.runs_on(q, cache, 80)
    assert prefill_attention.runs_on(torch.zeros(1, 2048, 32, 128), torch.zeros(2, 4, 8, 128), 32768)
    assert not prefill_attention.runs_on(q.bfloat16(), cache.bfloat16(), 80)  # float32 only
    assert not prefill_attention.runs_on(torch.zeros(1, 1, 8, 24), torch.zeros(2, 4, 4, 24), 80)  # head_dim 24
    assert not prefill_attention.runs_on(torch.zeros(1, 1, 2, 256), torch.zeros(2, 4, 2, 256), 80)  # over 128
    assert not prefill_attention.runs_on(q, cache, 1 << 20)  # a tile's scores past the scratch limit
