"""A model's forward compiled by inductor (`--compile`), with the cache writes kept in place.

Inductor cannot read the oneDNN-packed weights (packed_linear.py: "Cannot access storage of
OpaqueTensorImpl"), so a compiled model keeps plain weights and inductor's freezing treats them as
constants, packing them for its own matmuls. Compiled as written, the cache writes (index_copy_
into a view of an input) are functionalized into a copy of the whole KV cache every forward: here
they go through an opaque op that mutates the cache, which inductor leaves in place. Eager models
keep the plain write (the op costs eager about 0.5 ms a forward on the CPU: bench/compile_forward.py).
"""
from __future__ import annotations

from typing import Any

import torch

from vramledger.worker.models.llama import CausalLM, write_kv
from vramledger.worker.models.packed_linear import is_packed

# Options for every compiled model: weights as constants; code built in this process, so no pool
# of compile workers outlives startup as memory the ledger does not name.
INDUCTOR_OPTIONS: dict[str, Any] = {"freezing": True, "compile_threads": 1}


@torch.library.custom_op("vramledger::write_kv", mutates_args=("kv_cache",))
def opaque_write_kv(kv_cache: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    write_kv(kv_cache, layer, slots, k, v)


def compile_model(model: CausalLM, backend: str = "inductor"):
    """The model's forward compiled for every batch shape (dynamic sizes); the model must hold
    plain weights (load_model(..., pack=False)). Nothing compiles until the first call."""
    if any(is_packed(getattr(m, w)) for m, w, _ in model.projections()):
        raise ValueError("compile_model needs plain weights: load the model with pack=False")
    for layer in model.model.layers:
        layer.self_attn.write_kv = opaque_write_kv
    # Each model keeps several graphs of one forward (shape_classes), the target's and draft's alike.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    # Sizes equal by chance (cache slots and head_dim, say) must not be assumed equal ever after.
    torch.fx.experimental._config.use_duck_shape = False
    options = INDUCTOR_OPTIONS if backend == "inductor" else None
    return torch.compile(model, dynamic=True, backend=backend, options=options)


def shape_classes(num_logits: tuple[int, ...]) -> list[tuple[list[list[int]], list[int], int]]:
    """One forward (token rows, start positions, logits wanted) per kind of graph a step may need.

    Dynamic sizes still specialize on sizes 1 and on Python branches: one row or more, one new
    token a row or more, from position 0 (a prompt) or not, one logit a row or several. (The
    runner asks a compiled model for one logit at least and writes every row by index, so neither
    "no logits" nor "unpadded rows" needs graphs of its own.) Warming them all means no request
    waits for a compile.
    """
    return [([[1] * Q] * B, [start] * B, n)
            for B in (1, 2) for Q in (1, 3) for start in (0, 5) for n in num_logits if n <= Q]
