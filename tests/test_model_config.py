"""config.json read without transformers gives the models what transformers' AutoConfig gives them, field by
field, defaults included; configs whose fields transformers derives go to AutoConfig."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from vramledger.worker.config import DEFAULT_MODEL
from vramledger.worker.models.llama import Arch
from vramledger.worker.models.loader import load_config
from vramledger.worker.models.model_config import plain_config
from vramledger.worker.models.rope import rope_parameters

SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4)
CONFIGS = {
    "llama, sizes only": dict(architectures=["LlamaForCausalLM"], model_type="llama", **SIZES),
    "llama, every field": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=2,
                               head_dim=32, hidden_act="gelu", rms_norm_eps=1e-5, tie_word_embeddings=True,
                               max_position_embeddings=512, attention_bias=True, mlp_bias=True, eos_token_id=[1, 2],
                               rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **SIZES),
    "llama, rope_theta of older versions": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                                                rope_theta=1e6, rope_scaling=None, **SIZES),
    "qwen2, sizes only": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **SIZES),
    "qwen2, window off": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
                              sliding_window=4096, max_window_layers=1, tie_word_embeddings=True, eos_token_id=0,
                              rope_theta=1e6, **SIZES),
    "qwen2, layer types": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                               layer_types=["full_attention"] * 3, sliding_window=None, **SIZES),
    "mistral, sizes only": dict(architectures=["MistralForCausalLM"], model_type="mistral", **SIZES),
    "mistral, window": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=12,
                            num_key_value_heads=1, **SIZES),
    "mistral, no window": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None,
                               **SIZES),
}
FIELDS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
          "max_position_embeddings", "eos_token_id")


def seen_by_models(config) -> dict:
    """Every value the models (llama.py, rope.py, loader.py, the engine) take from a config."""
    arch = Arch(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {**{f: getattr(config, f) for f in FIELDS}, "head_dim": head_dim, "rope": rope_parameters(config),
            "biases": (arch.qkv_bias, arch.o_bias, arch.mlp_bias), "windows": arch.windows}


def checkpoint(directory: Path, config: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", CONFIGS)
def test_the_plain_config_gives_the_models_what_autoconfig_gives(name, tmp_path):
    directory = checkpoint(tmp_path / "m", CONFIGS[name])
    plain = plain_config(directory)
    assert plain is not None
    assert seen_by_models(plain) == seen_by_models(AutoConfig.from_pretrained(directory))


def test_the_shipped_pair_reads_plainly():
    for role in ("target", "draft"):
        path = Path(DEFAULT_MODEL).parent / f"tiny-coder-{role}"
        plain = load_config(str(path))
        assert not hasattr(plain, "to_dict")  # not a transformers config
        assert seen_by_models(plain) == seen_by_models(AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("change", [
    dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(rope_scaling={"type": "linear", "factor": 2.0}),
    dict(partial_rotary_factor=0.5),
    dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=8),
])
def test_derived_fields_go_to_autoconfig(change, tmp_path):
    directory = checkpoint(tmp_path / "m", {**CONFIGS["llama, sizes only"], **change})
    assert plain_config(directory) is None
    assert hasattr(load_config(str(directory)), "to_dict")

