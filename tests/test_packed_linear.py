"""Packed CPU weights compute what F.linear computes; the loader packs the decoder's projections."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from random_models import make_checkpoint

from worker.engine.cpu_threads import compute_threads
from worker.memory.profiler import module_tensor_bytes
from worker.models.loader import load_model
from worker.models.packed_linear import linear, pack, packable, plain

CPU = torch.device("cpu")
needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (80, 256), (3, 7, 256), (16, 1, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(shape, with_bias):
    torch.manual_seed(0)
    weight, x = torch.randn(384, 256), torch.randn(shape)
    bias = torch.randn(384) if with_bias else None
    packed = pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(plain(packed), weight, rtol=0, atol=0)


def test_only_float32_host_weights_are_packed():
    assert not packable(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not packable(torch.zeros(4, 4, device="meta"))
    assert packable(torch.zeros(4, 4)) == torch.backends.mkldnn.is_available()


@needs_mkldnn
def test_loaded_model_holds_packed_projections_counted_once(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)
    model = load_model(str(path), torch.float32, CPU)
    layer = model.model.layers[1]
    packed = [layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
              layer.mlp.down_proj.weight]
    assert all(w.is_mkldnn for w in packed)
    assert not model.model.embed_tokens.weight.is_mkldnn  # the embedding is indexed, never multiplied here
    # Packed tensors count as their values: the ledger's weights equal the unpacked model's.
    counted = module_tensor_bytes(model)
    for module, name in ((layer.self_attn, "qkv_weight"), (layer.self_attn.o_proj, "weight"),
                         (layer.mlp, "gate_up_weight"), (layer.mlp.down_proj, "weight")):
        setattr(module, name, torch.nn.Parameter(plain(getattr(module, name)), requires_grad=False))
    assert counted == module_tensor_bytes(model) > 0
    bf16 = load_model(str(path), torch.bfloat16, CPU)
    assert not any(p.is_mkldnn for p in bf16.parameters())


def test_cpu_threads_leave_a_core_to_the_server_unless_told():
    assert compute_threads(None, {}, cores=2) == 1
    assert compute_threads(None, {}, cores=16) == 15
    assert compute_threads(None, {}, cores=1) == 1
    assert compute_threads(None, {"OMP_NUM_THREADS": "4"}, cores=16) is None  # the user's choice stands
    assert compute_threads(3, {"OMP_NUM_THREADS": "4"}, cores=16) == 3  # the flag wins over both
