"""oneDNN-packed CPU weights compute what F.linear computes, at a bounded set of row counts built at startup;
loaded models hold packed projections (blocked where the kernel runs, else oneDNN)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from random_models import make_checkpoint

from vramledger.worker.kernels import blocked_linear
from vramledger.worker.memory.device import CpuDevice
from vramledger.worker.memory.profiler import module_tensor_bytes
from vramledger.worker.models import packed_linear
from vramledger.worker.models.loader import load_model
from vramledger.worker.models.packed_linear import (
    ROW_BUCKETS,
    is_packed,
    linear,
    pack_onednn,
    packable,
    plain,
    warm,
)

CPU = torch.device("cpu")
needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (80, 256), (3, 7, 256), (16, 1, 256), (300, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(shape, with_bias):
    torch.manual_seed(0)
    weight, x = torch.randn(384, 256), torch.randn(shape)
    bias = torch.randn(384) if with_bias else None
    packed = pack_onednn(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(plain(packed), weight, rtol=0, atol=0)


@needs_mkldnn
def test_non_contiguous_rows_are_multiplied_as_they_read():
    weight, x = torch.randn(64, 32), torch.randn(32, 10).t()  # [10, 32], column-major
    torch.testing.assert_close(linear(x, pack_onednn(weight)), F.linear(x, weight), rtol=1e-5, atol=1e-4)


@needs_mkldnn
def test_every_kernel_call_uses_a_bucketed_row_count(monkeypatch):
    seen = []
    real = packed_linear.kernel
    monkeypatch.setattr(packed_linear, "kernel", lambda rows, *args: seen.append(rows.shape[0]) or real(rows, *args))
    packed = pack_onednn(torch.randn(48, 16))
    for n in (1, 3, 5, 17, 81, 128, 129, 1000):
        assert linear(torch.randn(n, 16), packed).shape == (n, 48)
    assert set(seen) <= set(ROW_BUCKETS) and max(seen) == ROW_BUCKETS[-1]


@needs_mkldnn
def test_after_warm_no_row_count_builds_another_kernel():
    """oneDNN keeps ~0.5 MiB per kernel: 300 unbucketed row counts would add over 100 MiB."""
    device = CpuDevice()
    weight = pack_onednn(torch.randn(1024, 512))
    warm([(weight, None)])
    device.empty_cache()
    before = device.process_bytes()
    for n in range(1, 301):
        linear(torch.randn(n, 512), weight)
    device.empty_cache()
    assert device.process_bytes() - before < 4 << 20


def test_only_float32_host_weights_are_packed():
    assert not packable(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not packable(torch.zeros(4, 4, device="meta"))
    assert packable(torch.zeros(4, 4)) == torch.backends.mkldnn.is_available()


@needs_mkldnn
def test_packed_weights_count_with_their_layouts_padding():
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(pack_onednn(torch.randn(1000, 250)), requires_grad=False)
    assert module_tensor_bytes(module) >= 1000 * 250 * 4
    module.weight = torch.nn.Parameter(pack_onednn(torch.randn(256, 128)), requires_grad=False)
    assert module_tensor_bytes(module) == 256 * 128 * 4


@needs_mkldnn
def test_loaded_model_holds_packed_projections_counted_once(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)
    model = load_model(str(path), torch.float32, CPU)
    layer = model.model.layers[1]
    packed = [layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
              layer.mlp.down_proj.weight]
    assert all(is_packed(w) for w in packed)
    assert not is_packed(model.model.embed_tokens.weight)  # the embedding is indexed
    # Packed tensors count as their bytes: here (no padding) the same as the unpacked model's.
    counted = module_tensor_bytes(model)
    for module, name, _ in model.projections():
        setattr(module, name, torch.nn.Parameter(plain(getattr(module, name)), requires_grad=False))
    assert counted == module_tensor_bytes(model) > 0
    bf16 = load_model(str(path), torch.bfloat16, CPU)
    assert not any(is_packed(p) for p in bf16.parameters())


@needs_mkldnn
def test_a_long_input_goes_through_a_onednn_mlp_in_slices_with_the_same_result(tmp_path, monkeypatch):
    monkeypatch.setattr(blocked_linear, "available", lambda: False)  # oneDNN, as on a CPU without AVX-512
    path = make_checkpoint(tmp_path / "m", "llama", layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128)
    model = load_model(str(path), torch.float32, CPU)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 150, 64)  # 300 rows: two full slices and a short one
    rows_seen = []
    whole = type(mlp)._rows
    monkeypatch.setattr(type(mlp), "_rows", lambda self, part: rows_seen.append(tuple(part.shape[:-1])) or whole(self, part))
    with torch.inference_mode():
        sliced = mlp(x)
        assert rows_seen == [(128,), (128,), (44,)]
        for module, name, _ in model.projections():
            setattr(module, name, torch.nn.Parameter(plain(getattr(module, name)), requires_grad=False))
        rows_seen.clear()
        torch.testing.assert_close(sliced, mlp(x), rtol=1e-5, atol=1e-4)
        assert rows_seen == [(2, 150)]  # plain weights: the input whole, as it came
