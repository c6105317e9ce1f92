"""The CPU's float32 matmuls: F.linear, oneDNN-packed and blocked weights, in speed and in memory.

    python bench/packed_linear.py [--rows 1,5,16,80] [--repeats 7] [--shapes 64] [--threads 1]

Speed: one "pass" runs every decoder projection of the shipped target once, as a forward does;
passes alternate between plain weights, weights packed with torch.ops.mkldnn and weights blocked
for this project's kernel (worker/kernels/blocked_linear.py, where it runs); prints min/median/max
microseconds per pass and each layout's median over the blocked one's (over oneDNN's where the
kernel cannot run).
Memory: oneDNN builds and caches a primitive for every (weight shape, row count) it meets; the
process RSS is read after --shapes distinct row counts through one packed and one plain weight.
A server meets a new row count with almost every prompt length: the worker therefore pads rows to
a fixed set of counts and builds those kernels at startup (worker/models/packed_linear.py).
"""
from __future__ import annotations

import argparse

import psutil
import torch
import torch.nn.functional as F
from alternating import alternate, ratio, spread

from vramledger.worker.config import DEFAULT_MODEL
from vramledger.worker.kernels import blocked_linear
from vramledger.worker.models.loader import load_model

PACK_BATCH_HINT = 32  # the row count the packing is tuned for (vLLM's choice)


def packed_linear(x, weight):
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def speed(dense: list[torch.Tensor], rows: int, repeats: int) -> None:
    inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in dense}}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in dense]
    passes = {"plain": lambda: [F.linear(inputs[w.shape[1]], w) for w in dense],
              "oneDNN": lambda: [packed_linear(inputs[w.shape[1]], w) for w in packed]}
    if blocked_linear.available():
        blocked = [blocked_linear.pack(w) for w in dense]
        passes["blocked"] = lambda: [blocked_linear.linear(inputs[w.shape[1]], w) for w in blocked]
    results = {name: run() for name, run in passes.items()}
    diff = max((a - b).abs().max().item() for name in results for a, b in zip(results["plain"], results[name]))
    times = alternate(passes, repeats, calls=20)
    fastest = "blocked" if "blocked" in times else "oneDNN"
    print(f"{rows:3} rows: " + " | ".join(
        f"{name} {spread(t)} us ({ratio(t, times[fastest]):.2f}x)" for name, t in times.items())
        + f" | max diff {diff:.1e}", flush=True)


def growth(weight: torch.Tensor, shapes: int, linear) -> float:
    """MiB the process grows by while `linear` meets `shapes` distinct row counts."""
    process = psutil.Process()
    before = process.memory_info().rss
    for rows in range(1, shapes + 1):
        linear(torch.randn(rows, weight.shape[1]), weight)
    return (process.memory_info().rss - before) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,16,80")
    ap.add_argument("--repeats", type=int, default=7, help="timed blocks of 20 passes per layout")
    ap.add_argument("--shapes", type=int, default=64, help="distinct row counts for the memory figure")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the blocked kernel uses as many)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("torch was built without oneDNN")
    model = load_model(DEFAULT_MODEL, torch.float32, torch.device("cpu"), pack=False)
    dense = [w.detach() for layer in model.model.layers for w in (
        layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
        layer.mlp.down_proj.weight)]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {len(dense)} projections per pass"
          + ("" if blocked_linear.available() else "; the blocked kernel cannot run here"))
    for rows in map(int, args.rows.split(",")):
        speed(dense, rows, args.repeats)
    big = torch.randn(4096, 4096)
    plain_mib = growth(big, args.shapes, F.linear)
    packed_mib = growth(torch.ops.mkldnn._reorder_linear_weight(big, PACK_BATCH_HINT), args.shapes, packed_linear)
    blocked = (f", +{growth(blocked_linear.pack(big), args.shapes, blocked_linear.linear):.1f} MiB blocked"
               if blocked_linear.available() else "")
    print(f"memory: {args.shapes} row counts through a 4096x4096 weight: RSS +{plain_mib:.1f} MiB plain, "
          f"+{packed_mib:.1f} MiB oneDNN ({packed_mib / args.shapes:.2f} MiB per row count and weight shape)"
          + blocked)


if __name__ == "__main__":
    main()
