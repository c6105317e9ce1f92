"""Sizes read from a checkpoint directory (weights, KV per block); the large random pair of --scale large."""
from __future__ import annotations

import json
import logging
import math
import shutil
import struct
from pathlib import Path

log = logging.getLogger(__name__)

# bytes per element of the safetensors dtypes a checkpoint may hold; the worker converts to its dtype
_ST_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"}
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def kv_bytes_per_token(config: dict, element_bytes: int) -> int:
    """K and V of every layer for one token: 2 x layers x kv heads x head dim x element size."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * element_bytes


def kv_bytes_per_block(path: str | Path, block_size: int, element_bytes: int) -> int:
    return block_size * kv_bytes_per_token(read_config(path), element_bytes)


def _safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """Tensor shapes from a .safetensors header (8-byte length, then JSON), without reading the data."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__" and v.get("dtype") in _ST_DTYPES}


def weight_bytes(path: str | Path, element_bytes: int, packed: bool = False) -> int:
    """Bytes the model's weights hold at element_bytes each; a tied lm_head is counted once, or
    twice with packed weights (the worker packs a copy of it: models/llama.py, pack_linears)."""
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / n for n in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    shapes: dict[str, list[int]] = {}
    for file in files:
        shapes.update(_safetensors_shapes(file))
    if read_config(directory).get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
        if packed:
            shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return sum(math.prod(s) for s in shapes.values()) * element_bytes


# --- --scale large: Qwen2-shaped random checkpoints with the shipped tokenizer ---------------------
LARGE_SHAPES = {
    # ~0.75 B parameters: 1.5 GB of bf16 weights; KV 64 KiB per token
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=16, num_attention_heads=12,
                   num_key_value_heads=2),
    # ~0.07 B parameters: 0.13 GB of bf16 weights; KV 16 KiB per token
    "draft": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build_random_checkpoint(directory: Path, tokenizer_from: str | Path, shape: dict, seed: int,
                            device: str = "cpu", max_positions: int = 4096) -> Path:
    """A Qwen2ForCausalLM with random bf16 weights and the tokenizer of `tokenizer_from`, saved once.

    A directory that already holds this shape (its config matches) is reused as it is.
    """
    import torch
    import transformers

    directory = Path(directory)
    source = read_config(tokenizer_from)
    config = transformers.Qwen2Config(
        vocab_size=source["vocab_size"], max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=source.get("bos_token_id"), eos_token_id=source.get("eos_token_id"),
        pad_token_id=source.get("pad_token_id"), **shape)
    marker = directory / "selfcheck-shape.json"
    wanted = json.dumps({**shape, "vocab_size": source["vocab_size"], "seed": seed}, sort_keys=True)
    if marker.is_file() and marker.read_text() == wanted and any(directory.glob("*.safetensors")):
        return directory
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    log.info("building a random Qwen2-shaped checkpoint in %s (%s)", directory, shape)
    torch.manual_seed(seed)
    with torch.device(device):
        # transformers' decorator on .to hides nn.Module's signature from type checkers.
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_from) / name).is_file():
            shutil.copy(Path(tokenizer_from) / name, directory / name)
    marker.write_text(wanted)
    del model
    return directory
