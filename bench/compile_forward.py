"""torch.compile of the target's forward against the eager forward that serving runs (issue 14).

    python bench/compile_forward.py [--calls 60] [--shapes 1x1,16x1,16x5,4x5]

Shapes are rows x new tokens per row at context 150 (decode: Q=1, verify with k=4: Q=5).
Prints, per shape, the first compiled call (compilation), eager and compiled min/median/max ms
(calls alternating in one process), the ratio of medians and the largest logit difference.

Eager is the model as the worker loads it: projections packed for oneDNN. Inductor cannot read
those opaque tensors (NotImplementedError: Cannot access storage of OpaqueTensorImpl, torch 2.13),
so the compiled model is a second load with plain weights, compiled with inductor's freezing: it
treats the weights as constants and packs them for oneDNN itself.

Compiling the model as it is copies the whole KV cache: the cache writes (index_copy_ into a view of
an input) are functionalized. Here llama.write_kv becomes an opaque custom op that mutates the whole
cache tensor, which inductor leaves in place; eager calls keep the plain write, as serving does.
(Mutating the per-layer view through a custom op compiled to wrong cache contents with torch 2.13
and dynamic shapes.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config

import worker.models.llama as llama
from worker.config import DEFAULT_MODEL
from worker.models.attention import build_paged_batch
from worker.models.loader import load_model
from worker.models.packed_linear import plain


@torch.library.custom_op("vramledger_bench::write_kv", mutates_args=("kv_cache",))
def opaque_write_kv(kv_cache: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    kv_cache[0, layer].index_copy_(0, slots, k)
    kv_cache[1, layer].index_copy_(0, slots, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--shapes", default="1x1,16x1,16x5,4x5")
    args = ap.parse_args()
    cpu = torch.device("cpu")
    model = load_model(DEFAULT_MODEL, torch.float32, cpu)
    kv = torch.zeros(model.kv_cache_shape(600 * 16))
    serving_write_kv = llama.write_kv

    def eager(batch, kv_cache):  # as serving runs it: the plain cache write (the op costs ~0.5 ms a forward)
        llama.write_kv = serving_write_kv
        try:
            return model(batch, kv_cache)
        finally:
            llama.write_kv = opaque_write_kv

    to_compile = load_model(DEFAULT_MODEL, torch.float32, cpu)
    for module, name, _ in to_compile.projections():  # plain weights: inductor packs them itself
        setattr(module, name, torch.nn.Parameter(plain(getattr(module, name)), requires_grad=False))
    to_compile.requires_grad_(False)  # freezing folds only weights that no gradient needs
    inductor_config.freezing = True
    llama.write_kv = opaque_write_kv  # same values, same slots; what the compiled graph calls
    compiled = torch.compile(to_compile, dynamic=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.calls} calls each, alternating")
    for shape in args.shapes.split(","):
        B, Q = map(int, shape.split("x"))
        tables = [list(range(b * 32, b * 32 + 32)) for b in range(B)]

        def batch():
            return build_paged_batch([[1] * Q] * B, [150] * B, tables, 16, Q, cpu)
        with torch.inference_mode():
            start = time.perf_counter()
            compiled(batch(), kv)
            first = time.perf_counter() - start
            diff = (eager(batch(), kv) - compiled(batch(), kv)).abs().max().item()
            times = {eager: [], compiled: []}
            for _ in range(args.calls):
                for fn, runs in times.items():
                    start = time.perf_counter()
                    fn(batch(), kv)
                    runs.append(time.perf_counter() - start)
        (e, c) = (sorted(runs) for runs in times.values())
        spread = lambda r: f"{r[0] * 1e3:.2f}/{statistics.median(r) * 1e3:.2f}/{r[-1] * 1e3:.2f}"  # noqa: E731
        print(f"{B:2} rows x {Q} tokens: first compiled call {first:5.1f} s | eager {spread(e)} ms | "
              f"compiled {spread(c)} ms | eager/compiled {statistics.median(e) / statistics.median(c):.2f}x | "
              f"max logit diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
