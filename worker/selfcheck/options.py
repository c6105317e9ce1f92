"""The flags of `python -m vramledger.worker selfcheck`."""
from __future__ import annotations

import argparse

from vramledger.worker.config import DTYPES


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    p.add_argument("--keep-going", action="store_true",
                   help="run every scenario even after one failed (default: stop at the first failure)")
    p.add_argument("--scale", choices=("shipped", "large"), default="shipped",
                   help="shipped: the tiny pair; large: random Qwen2-shaped models of 1.5 GB + 0.13 GB "
                        "(bf16), built once with transformers into --cache-dir")
    p.add_argument("--model", default=None, help="target checkpoint directory (default: --scale's)")
    p.add_argument("--draft-model", default=None, help="draft checkpoint directory (default: --scale's)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="default: 512 on the CPU, 2048 on CUDA")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="requests at once in the loads (default: 8 on the CPU, 256 on CUDA, "
                        "64 with --scale large)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="default: max-model-len on the CPU (one prompt a prefill step), the worker's on CUDA")
    p.add_argument("--workdir", default=None,
                   help="where the processes' logs go (default: a temporary directory, "
                        "removed when every scenario passed)")
    p.add_argument("--cache-dir", default=None,
                   help="where --scale large keeps its checkpoints (default: ~/.cache/vramledger/selfcheck)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="scenarios 5 and 6 (GPU only): the interpreter of vLLM's environment, where the vramledger "
                        "vLLM plugin is installed (default: this one, if it has vLLM)")
    p.add_argument("--log-level", default="WARNING")
