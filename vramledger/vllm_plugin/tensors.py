"""Bytes that a vLLM model holds, each storage counted once (tied weights, views of one KV buffer).

vLLM's CPU backend packs each linear layer's weight for its matmul kernel
(vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm): a oneDNN handle whose packed
copy lives in C++ (k x n elements of the weight's dtype), or a packed tensor (sgl, zentorch) held
by the layer's cpu_linear closure. A linear layer's own parameter is then emptied, so its packed
copy is its weight; an embedding keeps its parameter for lookups, so a tied LM head's packed copy
is a second one, for the kernel only.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class ModelBytes:
    """A model's bytes: its weights (in whatever layout vLLM holds them), and kernel-only copies."""

    weights: int = 0
    kernel_copies: int = 0


def model_bytes(model, seen: set) -> ModelBytes:
    """What model holds, storages in seen (data pointers) not counted again; adds its own to seen."""
    held = ModelBytes(weights=storage_bytes(model.parameters(), seen) + storage_bytes(model.buffers(), seen))
    for module in model.modules():
        packed = _packed_bytes(module, seen)
        weight = getattr(module, "weight", None)
        if weight is not None and weight.numel() == 0:  # emptied after packing: the copy is the weight
            held.weights += packed
        else:
            held.kernel_copies += packed
    return held


def storage_bytes(tensors: Iterable, seen: set) -> int:
    """Bytes of the storages behind tensors not in seen (data pointers), adding them to seen."""
    total = 0
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (AttributeError, RuntimeError, NotImplementedError):  # None, meta or subclassed tensors
            continue
        if nbytes and key not in seen:
            seen.add(key)
            total += nbytes
    return total


def _packed_bytes(module, seen: set) -> int:
    """The packed copies a CPU layer's cpu_linear closure holds (0 elsewhere)."""
    closure = getattr(getattr(module, "cpu_linear", None), "__closure__", None) or ()
    total = 0
    for cell in closure:
        value = cell.cell_contents
        if hasattr(value, "untyped_storage"):
            total += storage_bytes([value], seen)
        elif hasattr(value, "handler_tensor") and ("handle", id(value)) not in seen:  # a oneDNN handle
            seen.add(("handle", id(value)))
            total += value.k * value.n * module.weight.element_size()
    return total
