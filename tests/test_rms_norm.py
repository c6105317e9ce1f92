"""The C RMSNorm computes Hugging Face's formula; the model uses it for float32 on the CPU only."""
from __future__ import annotations

import shutil

import pytest
import torch

from vramledger.worker.kernels import native, rms_norm
from vramledger.worker.models.llama import RMSNorm

needs_kernel = pytest.mark.skipif(not rms_norm.available(), reason="no AVX-512 or AVX2, or no C compiler here")


def hugging_face(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (3, 4, 256), (2, 1000), (0, 32)])
def test_matches_hugging_faces_formula(shape):
    torch.manual_seed(shape[-1])
    x, weight = torch.randn(shape) * 3, torch.randn(shape[-1])
    out = rms_norm.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out, hugging_face(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


@needs_kernel
def test_strided_rows_and_a_large_eps():
    x, weight = torch.randn(64, 6).t(), torch.randn(64)  # [6, 64], column-major
    torch.testing.assert_close(rms_norm.rms_norm(x, weight, 0.5), hugging_face(x, weight, 0.5), rtol=1e-6, atol=1e-6)


@needs_kernel
def test_the_module_uses_the_kernel_for_float32_only(monkeypatch):
    calls = []
    real = rms_norm.rms_norm
    monkeypatch.setattr(rms_norm, "rms_norm", lambda *a: calls.append(a[0].dtype) or real(*a))
    norm = RMSNorm(32, 1e-5)
    norm(torch.randn(2, 32))
    assert calls == [torch.float32]
    half = RMSNorm(32, 1e-5).to(torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(half(x), hugging_face(x, half.weight, 1e-5))
    assert calls == [torch.float32]


def test_the_kernel_loads_wherever_it_can_run():
    can_run = native.isa() is not None and shutil.which("cc")
    assert rms_norm.available() == bool(can_run)
