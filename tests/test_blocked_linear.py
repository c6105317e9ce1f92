"""The blocked matmul kernel computes what F.linear computes, and a row the same at any batch size;
where it cannot run, weights go to oneDNN."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vramledger.worker.kernels import blocked_linear, native
from vramledger.worker.models import packed_linear

needs_kernel = pytest.mark.skipif(not blocked_linear.available(), reason="no AVX-512 or AVX2, or no C compiler here")


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 40, 300])
@pytest.mark.parametrize("out_features,in_features", [(16, 1), (48, 7), (80, 256), (384, 256), (2048, 96)])
def test_matches_f_linear(rows, out_features, in_features):
    torch.manual_seed(rows)
    weight, x, bias = torch.randn(out_features, in_features), torch.randn(rows, in_features), torch.randn(out_features)
    packed = blocked_linear.pack(weight)
    assert blocked_linear.is_blocked(packed) and packed.shape == (out_features // 16, in_features, 16)
    torch.testing.assert_close(blocked_linear.linear(x, packed), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(blocked_linear.linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(blocked_linear.unpack(packed), weight, rtol=0, atol=0)


@needs_kernel
def test_batched_and_strided_inputs_keep_their_leading_shape():
    weight = torch.randn(64, 32)
    packed = blocked_linear.pack(weight)
    strided = torch.randn(32, 10).t()  # [10, 32], column-major
    torch.testing.assert_close(blocked_linear.linear(strided, packed), F.linear(strided, weight), rtol=1e-5, atol=1e-4)
    batched = torch.randn(3, 7, 32)
    out = blocked_linear.linear(batched, packed)
    assert out.shape == (3, 7, 64)
    torch.testing.assert_close(out, F.linear(batched, weight), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_with_any_thread_count():
    """Greedy decoding with the draft equals plain greedy only if verifying k+1 rows reproduces
    what one row gives: each output sums over the inputs in one fixed order."""
    torch.manual_seed(0)
    packed = blocked_linear.pack(torch.randn(320, 256))
    x = torch.randn(13, 256)
    batch = blocked_linear.linear(x, packed)
    alone = torch.cat([blocked_linear.linear(x[i:i + 1], packed) for i in range(13)])
    assert torch.equal(batch, alone)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(blocked_linear.linear(x, packed), batch)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_other_input_dtypes_are_refused_not_misread():
    packed = blocked_linear.pack(torch.randn(16, 8))
    with pytest.raises(TypeError, match="float32"):
        blocked_linear.linear(torch.randn(2, 8, dtype=torch.bfloat16), packed)


@needs_kernel
def test_weights_that_do_not_fill_whole_blocks_go_to_onednn():
    assert blocked_linear.is_blocked(packed_linear.pack(torch.randn(64, 32)))
    odd = packed_linear.pack(torch.randn(50, 32))  # a vocabulary of 50: not a multiple of 16
    assert odd.is_mkldnn and packed_linear.is_packed(odd)
    x = torch.randn(3, 32)
    torch.testing.assert_close(packed_linear.linear(x, odd), F.linear(x, packed_linear.plain(odd)), rtol=1e-5, atol=1e-4)


def test_without_the_kernel_weights_go_to_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    native.load.cache_clear()
    blocked_linear._kernel.cache_clear()
    try:
        assert not blocked_linear.available()
        assert packed_linear.pack(torch.randn(64, 32)).is_mkldnn == torch.backends.mkldnn.is_available()
    finally:
        native.load.cache_clear()
        blocked_linear._kernel.cache_clear()
