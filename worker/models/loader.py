"""Load a Hugging Face checkpoint directory into our model code."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

from vramledger.worker.models.llama import CausalLM
from vramledger.worker.models.model_config import plain_config, read_config
from vramledger.worker.models.tokenizer import direct_tokenizer, generic_config

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
    """The checkpoint's config: its plain fields where they are all the models need (model_config.py),
    else transformers' config class."""
    directory = checkpoint_dir(path)
    arch = (read_config(directory).get("architectures") or ["?"])[0]
    if arch not in SUPPORTED:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED)}")
    plain = plain_config(directory)
    if plain is not None:
        return plain
    from transformers import AutoConfig

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


# The safetensors format: u64 header length, a JSON header {name: {dtype, shape, data_offsets}}, data.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}


def read_safetensors_header(file) -> tuple[dict[str, dict], int]:
    """({name: {dtype, shape, data_offsets}}, offset of the data) of an open safetensors file."""
    raw = file.read(8)
    if len(raw) != 8:
        raise ModelLoadError(f"{file.name}: not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(file.read(length))
    except (ValueError, MemoryError) as exc:
        raise ModelLoadError(f"{file.name}: not a safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    return header, 8 + length


def _read_into(file, dest: torch.Tensor, dtype: torch.dtype, offset: int, nbytes: int) -> None:
    """Fill `dest` with the file's bytes at offset (stored as `dtype`): read, never mapped.

    Same dtype on the CPU: straight into dest's memory; otherwise through one host temporary.
    """
    direct = dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
    buffer = dest if direct else torch.empty(dest.shape, dtype=dtype)
    if buffer.numel() * buffer.element_size() != nbytes:
        raise ModelLoadError(f"{file.name}: tensor at byte {offset} holds {nbytes} bytes, "
                             f"expected {tuple(dest.shape)} x {buffer.element_size()}")
    view = buffer.reshape(-1).view(torch.uint8).numpy().data if nbytes else memoryview(b"")
    file.seek(offset)
    done = 0
    while done < nbytes:
        n = file.readinto(view[done:])
        if not n:
            raise ModelLoadError(f"{file.name}: truncated (tensor at byte {offset})")
        done += n
    if not direct:
        dest.copy_(buffer)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Give every parameter of a meta-built model real, uninitialised storage; {name: tensor}."""
    params = {}
    for name, meta in model.named_parameters():  # tied parameters appear once
        owner, _, leaf = name.rpartition(".")
        real = nn.Parameter(torch.empty(meta.shape, dtype=dtype, device=device), requires_grad=False)
        setattr(model.get_submodule(owner), leaf, real)
        params[name] = real.data
    return params


def load_model(path: str, dtype: torch.dtype, device: torch.device, pack: bool = True) -> CausalLM:
    """Build the model on the meta device, then read the checkpoint into its (fused) parameters.

    Each weight is held once: tensors are read (not mapped) straight into their final storage
    (q/k/v and gate/up into their rows of the fused matrices), so no checkpoint file stays
    mapped and no unfused copy is ever made, on the host or in a CUDA allocator's cache.
    pack=False keeps the projections plain, for torch.compile (compiled.py).
    """
    config = load_config(path)
    with torch.device("meta"):
        model = CausalLM(config)
        layout = model.fuse_projections()  # shapes only: {checkpoint name: (fused name, rows)}
    tied = bool(config.tie_word_embeddings)
    params = _materialize(model, dtype, device)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    expected = {name for name in params if not (tied and name == "lm_head.weight")}
    expected = (expected - {dst for dst, _, _ in layout.values()}) | set(layout)
    filled: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in _weight_files(Path(path)):
            with open(file, "rb", buffering=0) as f:
                header, data_start = read_safetensors_header(f)
                for name, info in header.items():
                    if tied and name == "lm_head.weight":
                        continue
                    dst, rows = (layout[name][0], layout[name][1:]) if name in layout else (name, None)
                    if dst not in params:
                        unexpected.append(name)
                        continue
                    dest = params[dst] if rows is None else params[dst][rows[0]:rows[1]]
                    stored = SAFETENSORS_DTYPES.get(info["dtype"])
                    if stored is None:
                        raise ModelLoadError(f"{file}: {name} has unsupported dtype {info['dtype']}")
                    if list(dest.shape) != list(info["shape"]):
                        raise ModelLoadError(f"{path}: {name} has shape {info['shape']}, "
                                             f"{config.architectures[0]} expects {list(dest.shape)}")
                    begin, end = info["data_offsets"]
                    _read_into(f, dest, stored, data_start + begin, end - begin)
                    filled.add(name)
    missing = expected - filled
    if missing or unexpected:
        raise ModelLoadError(f"{path}: checkpoint does not match {config.architectures[0]}: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.rotary.to(device)  # computed, not loaded
    if pack:
        model.pack_linears()
    return model.eval().requires_grad_(False)


# What a fast tokenizer is built from: the model in tokenizer.json, its special tokens in the others.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def same_tokenizer_files(path: str, other: str) -> bool:
    """Whether two checkpoints hold byte-identical fast-tokenizer files (both with a tokenizer.json), so
    that they load the same tokenizer. False says nothing: the tokenizers may still be alike."""
    a, b = Path(path), Path(other)
    if not ((a / "tokenizer.json").is_file() and (b / "tokenizer.json").is_file()):
        return False
    for name in TOKENIZER_FILES:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file() or (fa.is_file() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True


def import_model_libraries(path: str) -> None:
    """Import what loading the tokenizer and the config of the checkpoint at `path` needs, so that
    start-up times the imports apart from the loads: the tokenizers library and jinja2 where the
    checkpoint's tokenizer loads without transformers (tokenizer.py, imported above), else
    transformers, which loads its parts on first use (a model's config class alone pulled in 1-2 s of
    modules). Reading the config fails early on a bad path."""
    if generic_config(checkpoint_dir(path)) is None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        del AutoTokenizer, PreTrainedTokenizerFast
    load_config(path)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer: with the tokenizers library alone where transformers would build the
    same one (tokenizer.py), else transformers' AutoTokenizer."""
    directory = checkpoint_dir(path)
    try:
        direct = direct_tokenizer(directory)
        if direct is not None:
            return direct
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {exc}") from exc
