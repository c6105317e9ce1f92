"""Load a Hugging Face checkpoint directory into our model code."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from worker.models.llama import CausalLM

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class ModelLoadError(ValueError):
    """A checkpoint directory that cannot be served, with the reason."""


def checkpoint_dir(path: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"model path {path!r} is not a directory (expected a Hugging Face "
                             "checkpoint directory with config.json and *.safetensors)")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{path}: config.json is missing")
    return directory


def load_config(path: str):
    from transformers import AutoConfig

    directory = checkpoint_dir(path)
    arch = (json.loads((directory / "config.json").read_text()).get("architectures") or ["?"])[0]
    if arch not in SUPPORTED:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED)}")
    return AutoConfig.from_pretrained(directory, local_files_only=True)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights found")
    return files


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model on the meta device, then take the checkpoint's tensors as parameters."""
    config = load_config(path)
    with torch.device("meta"):
        model = CausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        state.update(load_file(file, device=str(device)))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ModelLoadError(f"{path}: checkpoint does not match {config.architectures[0]}: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary.to(device)  # computed, not loaded
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    checkpoint_dir(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {exc}") from exc
