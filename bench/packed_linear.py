"""Packed oneDNN weights against F.linear, over the shipped target's decoder projections (issue 14).

    python bench/packed_linear.py [--rows 1,5,16,80] [--repeats 7] [--threads 1]

One "pass" runs every projection of every layer once, as a forward does (the weights stream from
memory, not from a warm L1). Passes alternate between the two layouts; prints min/median/max
microseconds per pass and the ratio of medians, and the largest difference of the outputs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from worker.config import DEFAULT_MODEL
from worker.models.loader import load_model
from worker.models.packed_linear import linear, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,16,80")
    ap.add_argument("--repeats", type=int, default=7, help="timed blocks of 20 passes per layout")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(DEFAULT_MODEL, torch.float32, torch.device("cpu"))
    packed = [w for layer in model.model.layers for w in (
        layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
        layer.mlp.down_proj.weight)]
    if not all(w.is_mkldnn for w in packed):
        raise SystemExit("the loader did not pack the weights (torch without oneDNN?)")
    dense = [plain(w).contiguous() for w in packed]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {len(packed)} projections per pass")
    for rows in map(int, args.rows.split(",")):
        inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in dense}}
        passes = {"plain": lambda: [F.linear(inputs[w.shape[1]], w) for w in dense],
                  "packed": lambda: [linear(inputs[w.shape[1]], w) for w in packed]}
        diff = max((a - b).abs().max().item() for a, b in zip(passes["plain"](), passes["packed"]()))
        times = {name: [] for name in passes}
        for _ in range(args.repeats):
            for name, run in passes.items():
                start = time.perf_counter()
                for _ in range(20):
                    run()
                times[name].append((time.perf_counter() - start) / 20 * 1e6)
        spread = {n: f"{min(t):7.0f} {statistics.median(t):7.0f} {max(t):7.0f}" for n, t in times.items()}
        ratio = statistics.median(times["plain"]) / statistics.median(times["packed"])
        print(f"{rows:3} rows: plain {spread['plain']} us | packed {spread['packed']} us | "
              f"plain/packed {ratio:.2f}x | max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
