"""Paged attention: this project's kernel against the torch path (gather + mask + SDPA), in one run.

    python bench/paged_attention.py [--rounds 15] [--context 150] [--threads 2] [--shared-prefix]

Shapes of the shipped target (8 heads, 4 key/value heads, head_dim 32), 8 layers' caches over
scattered blocks (a decode step reads every layer's, so the caches do not all fit in L3), decode
(1 token a row) and verify (5: k=4) steps at 1-32 rows. The two paths alternate round by round;
prints min/median us per layer and the ratio of medians. The torch path gathers into buffers kept
between calls, as the model's workspace does. With --shared-prefix every row's table starts with the
same blocks, the cached positions' full blocks (rows decoding after one cached prefix), and the
blocks of the rest are each row's own.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vramledger.worker.kernels import paged_attention
from vramledger.worker.models.attention import GatherWorkspace, build_paged_batch
from vramledger.worker.models.llama import read_context

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 8, 4, 32, 16, 8
SHAPES = [(1, 1), (4, 1), (16, 1), (32, 1), (1, 5), (16, 5), (32, 5)]  # (rows, new tokens a row)


def torch_path(q, cache, batch, workspace):
    B, Q, H, D = q.shape
    keys, values = (read_context(cache[i], batch.gather_slots, buffer)
                    for i, buffer in enumerate(workspace.pair(batch.gather_slots.numel(), cache[0])))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=batch.mask(None, q.dtype),
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(B, Q, -1)


def kernel_path(q, cache, batch, workspace):
    return paged_attention.attend(q, cache[0], cache[1], batch.gather_slots, batch.positions, batch.context_lens,
                                  None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--context", type=int, default=150, help="cached positions before the new tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shared-prefix", action="store_true", help="rows share the cached positions' full blocks")
    args = ap.parse_args()
    if not paged_attention.available():
        raise SystemExit("the kernel cannot run here (neither AVX-512 nor AVX2, or no C compiler)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{HEADS} heads, {KV_HEADS} kv heads, head_dim {DIM}, {args.context} cached positions, {LAYERS} layers, "
          f"{args.threads} threads, {args.rounds} rounds{', one shared prefix' if args.shared_prefix else ''}; "
          "us per layer, min/median")
    print("| rows x tokens | kernel | gather + SDPA | SDPA / kernel |\n|---|---|---|---|")
    for rows, tokens in SHAPES:
        shared = args.context // BLOCK if args.shared_prefix else 0  # blocks every row's table starts with
        own = (args.context + tokens) // BLOCK + 1 - shared
        blocks = torch.randperm(shared + rows * own).tolist()
        caches = torch.randn(LAYERS, 2, len(blocks) * BLOCK, KV_HEADS, DIM)
        tables = [blocks[:shared] + blocks[shared + r * own:shared + (r + 1) * own] for r in range(rows)]
        batch = build_paged_batch([[1] * tokens] * rows, [args.context] * rows, tables, BLOCK, 1, torch.device("cpu"))
        q = torch.randn(rows, tokens, HEADS + 2 * KV_HEADS, DIM)[:, :, :HEADS]  # a view, as the model's
        workspace = GatherWorkspace()
        times = {kernel_path: [], torch_path: []}
        for r in range(args.rounds + 1):
            for path in times:
                start = time.perf_counter()
                for layer in range(LAYERS):
                    path(q, caches[layer], batch, workspace)
                if r:  # the first round warms up
                    times[path].append((time.perf_counter() - start) / LAYERS * 1e6)
        k, t = (statistics.median(v) for v in times.values())
        print(f"| {rows} x {tokens} | {min(times[kernel_path]):.0f} / {k:.0f} | {min(times[torch_path]):.0f} / {t:.0f} "
              f"| {t / k:.2f}x |")


if __name__ == "__main__":
    main()
