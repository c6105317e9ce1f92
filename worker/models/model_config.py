"""A checkpoint's config.json as the worker's models read it, without transformers' config classes (importing
them pulls in torch.distributed and sympy, a fifth of the worker's start-up). Each field the models read is
the file's value or the default of the architecture's transformers class; tests/test_model_config.py
compares every field with transformers' AutoConfig. A config this reader does not cover (a scaled rotary
embedding, whose frequencies transformers computes, or Qwen2's sliding windows) is left to AutoConfig."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

# transformers' defaults of the fields the models read (LlamaConfig, Qwen2Config, MistralConfig).
COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
              attention_bias=False, mlp_bias=False, head_dim=None, num_key_value_heads=None, sliding_window=None,
              layer_types=None)
DEFAULTS = {
    "LlamaForCausalLM": dict(COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                             num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                             eos_token_id=2),
    "Qwen2ForCausalLM": dict(COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                             max_position_embeddings=32768, eos_token_id=None),
    "MistralForCausalLM": dict(COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               max_position_embeddings=4096 * 32, eos_token_id=2, sliding_window=4096),
}


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def plain_config(directory: Path) -> SimpleNamespace | None:
    """The fields the models read, or None where transformers' config class must derive them."""
    raw = read_config(directory)
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in DEFAULTS:
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" or "partial_rotary_factor" in raw:
        return None
    if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        return None
    if arch == "MistralForCausalLM" and raw.get("layer_types"):
        return None
    fields = {name: raw.get(name, default) for name, default in DEFAULTS[arch].items()}
    if arch == "Qwen2ForCausalLM":
        fields["sliding_window"] = None  # Qwen2Config drops it unless use_sliding_window
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", fields.pop("rope_theta"))}
    return SimpleNamespace(architectures=[arch], **fields)
