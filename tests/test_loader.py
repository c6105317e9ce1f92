"""Each weight is held once: no checkpoint file stays mapped, no unfused copy is kept."""
from __future__ import annotations

import pytest
import torch
from random_models import make_checkpoint

from vramledger.worker.memory.device import CpuDevice
from vramledger.worker.memory.profiler import module_tensor_bytes
from vramledger.worker.models.loader import ModelLoadError, load_config, load_model
from vramledger.worker.models.packed_linear import is_packed, plain

CPU = torch.device("cpu")
MiB = 1 << 20


@pytest.fixture(scope="module")
def qwen2_shaped(tmp_path_factory):
    """A Qwen2-shaped model (GQA, q/k/v biases, tied embeddings, wide MLP) of about 120 MiB."""
    return str(make_checkpoint(tmp_path_factory.mktemp("qwen2") / "m", "qwen2", layers=8, hidden=512,
                               heads=8, kv_heads=2, intermediate=2048, std=0.02))


def _safetensors_mappings(directory: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if ".safetensors" in line and directory in line]


def test_load_maps_no_file_and_grows_by_the_weights_alone(qwen2_shaped):
    cpu = CpuDevice()
    load_config(qwen2_shaped)  # reads the config (and imports what reading it needs) before the measurement
    cpu.empty_cache()
    before = cpu.process_bytes()
    model = load_model(qwen2_shaped, torch.float32, CPU)
    cpu.empty_cache()
    growth = cpu.process_bytes() - before
    weights = module_tensor_bytes(model)
    assert weights > 100 * MiB
    assert _safetensors_mappings(qwen2_shaped) == []
    assert abs(growth - weights) <= 0.10 * weights, (growth / MiB, weights / MiB)
    # Fused: q/k/v and gate/up exist only as the fused matrices.
    names = {n for n, _ in model.named_parameters()}
    assert not any(p in n for n in names for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    assert "model.layers.0.self_attn.qkv_bias" in names


def test_fused_rows_hold_the_checkpoint_tensors(qwen2_shaped):
    from safetensors.torch import load_file

    model = load_model(qwen2_shaped, torch.float32, CPU)
    state = load_file(f"{qwen2_shaped}/model.safetensors")
    attn, mlp = model.model.layers[3].self_attn, model.model.layers[3].mlp
    qkv = torch.cat([state[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(plain(attn.qkv_weight), qkv, rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_bias, torch.cat([state[f"model.layers.3.self_attn.{p}_proj.bias"]
                                                         for p in "qkv"]), rtol=0, atol=0)
    gate_up = torch.cat([state[f"model.layers.3.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(plain(mlp.gate_up_weight), gate_up, rtol=0, atol=0)
    # tied: the head is a packed copy of the embedding (which stays plain: it is indexed) ...
    assert is_packed(model.lm_head.weight) and not is_packed(model.model.embed_tokens.weight)
    torch.testing.assert_close(plain(model.lm_head.weight), model.model.embed_tokens.weight, rtol=0, atol=0)
    unpacked = load_model(qwen2_shaped, torch.float32, CPU, pack=False)
    assert unpacked.lm_head.weight is unpacked.model.embed_tokens.weight  # ... or one tensor unpacked


def test_other_dtype_goes_through_one_temporary_and_converts(qwen2_shaped):
    # The path CUDA takes: read into a host buffer, copy (and convert) into the final rows.
    fp32 = load_model(qwen2_shaped, torch.float32, CPU)
    bf16 = load_model(qwen2_shaped, torch.bfloat16, CPU)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(bf16.model.layers[1].mlp.gate_up_weight,
                               plain(fp32.model.layers[1].mlp.gate_up_weight).to(torch.bfloat16), rtol=0, atol=0)
    assert bf16.rotary.inv_freq.dtype == torch.float32  # computed, kept in float32


def test_fusing_a_loaded_model_frees_the_originals():
    # fuse_linears on real tensors (not the loader's path): the originals do not stay.
    from vramledger.worker.models.llama import fuse_linears

    module = torch.nn.Module()
    module.a, module.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)
    a, b = module.a.weight.detach().clone(), module.b.weight.detach().clone()
    layout = fuse_linears(module, "ab", ("a", "b"))
    assert layout == {"a.weight": ("ab_weight", 0, 4), "b.weight": ("ab_weight", 4, 6),
                      "a.bias": ("ab_bias", 0, 4), "b.bias": ("ab_bias", 4, 6)}
    assert not hasattr(module, "a") and not hasattr(module, "b")
    torch.testing.assert_close(module.ab_weight, torch.cat([a, b]))


def test_checkpoint_that_does_not_match_is_refused(tmp_path, qwen2_shaped):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(qwen2_shaped, bad)
    state = load_file(bad / "model.safetensors")
    state.pop("model.layers.2.self_attn.k_proj.weight")
    state["model.layers.2.extra.weight"] = torch.zeros(2)
    save_file(state, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing \['model.layers.2.self_attn.k_proj.weight'\], "
                                             r"unexpected \['model.layers.2.extra.weight'\]"):
        load_model(str(bad), torch.float32, CPU)
    state["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(state, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match="k_proj.weight has shape"):
        load_model(str(bad), torch.float32, CPU)


def test_a_draft_tokenizer_is_compared_by_its_files_then_by_loading_it(checkpoints, tmp_path):
    """Byte-identical tokenizer files need no second load; a draft whose tokenizer differs is still refused."""
    import json
    import shutil

    from vramledger.worker.config import EngineConfig
    from vramledger.worker.engine.engine_parts import check_same_tokenizer
    from vramledger.worker.models.loader import load_tokenizer, same_tokenizer_files

    target, draft = checkpoints["llama"], checkpoints["llama-draft"]
    assert same_tokenizer_files(target, draft)
    other = shutil.copytree(draft, tmp_path / "other-vocab")
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["vocab"]["zzz-added"] = len(spec["model"]["vocab"])  # a vocabulary of its own
    (other / "tokenizer.json").write_text(json.dumps(spec))
    assert not same_tokenizer_files(target, str(other))
    with pytest.raises(ModelLoadError, match="differs from the target"):
        check_same_tokenizer(load_tokenizer(target), EngineConfig(model=target, draft_model=str(other)))
    check_same_tokenizer(load_tokenizer(target), EngineConfig(model=target, draft_model=draft))
