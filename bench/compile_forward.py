"""torch.compile of the target's forward against the eager forward that serving runs.

    python bench/compile_forward.py [--calls 60] [--shapes 1x1,16x1,16x5,4x5]

Shapes are rows x new tokens per row at context 150 (decode: Q=1, verify with k=4: Q=5).
Prints, per shape, the first compiled call (compilation), eager and compiled min/median/max ms
(calls alternating in one process), the ratio of medians and the largest logit difference.

Eager is the model as the worker loads it: projections packed for oneDNN. The compiled model is a
second load with plain weights, compiled as `--compile` does (worker/models/compiled.py: inductor's
freezing packs the weights itself; the cache writes go through an opaque op that mutates the whole
cache in place). (Mutating the per-layer view through a custom op compiled to wrong cache contents
with torch 2.13 and dynamic shapes.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from vramledger.worker.config import DEFAULT_MODEL
from vramledger.worker.models.attention import build_paged_batch
from vramledger.worker.models.compiled import compile_model
from vramledger.worker.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--shapes", default="1x1,16x1,16x5,4x5")
    args = ap.parse_args()
    cpu = torch.device("cpu")
    eager = load_model(DEFAULT_MODEL, torch.float32, cpu)
    kv = torch.zeros(eager.kv_cache_shape(600 * 16))
    compiled = compile_model(load_model(DEFAULT_MODEL, torch.float32, cpu, pack=False))
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
