"""Adaptive vs fixed k on the shipped pair, with ours plain as the floor, at small and large batches.

Each row runs its three engines in turn, several times (the machine's load hits all three alike),
after one warm-up run each (the adaptive policy keeps what it learnt, as a server does):
  python bench/speculation.py [--batches 1,16,32] [--tokens 128] [--repeats 5] [--temperature 0]
                              [-k 4] [--adaptive-k K]   (adaptive's upper bound; default -k)
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "    def __repr__(self):\n", "def parse_args(argv):\n    parser = ", "try:\n    import json\n",
           "for line in sys.stdin:\n", "def _check(value, name):\n    if not "]


def count_k(engine: LLMEngine) -> Counter:
    """The k of every decode step the engine runs from now on."""
    counts, start = Counter(), engine.speculation.start_step

    def counted(*args, **kwargs):
        k = start(*args, **kwargs)
        counts[k] += 1
        return k
    engine.speculation.start_step = counted
    return counts


def row(batch: int, args) -> dict[str, list[float]]:
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    modes = {"plain": {"draft_model": None}, "fixed": {"speculation": "fixed", "num_speculative_tokens": args.k},
             "adaptive": {"speculation": "adaptive", "num_speculative_tokens": args.adaptive_k or args.k}}
    engines = {m: LLMEngine(EngineConfig(max_num_seqs=batch, max_model_len=512, **kw)) for m, kw in modes.items()}
    for engine in engines.values():
        engine.generate(prompts, params)  # warm-up
    ks = count_k(engines["adaptive"])
    speeds = {m: [] for m in engines}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            start = time.perf_counter()
            engine.generate(prompts, params)
            speeds[mode].append(batch * args.tokens / (time.perf_counter() - start))
    steps = sum(ks.values())
    print(f"batch {batch}: adaptive k per decode step " +
          ", ".join(f"k={k} {n / steps:.0%}" for k, n in sorted(ks.items())))
    return speeds


def spread(values: list[float]) -> str:
    return f"{min(values):7.1f} / {statistics.median(values):7.1f} / {max(values):7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("-k", type=int, default=4, help="fixed k, and adaptive's upper bound")
    ap.add_argument("--adaptive-k", type=int, default=None, help="adaptive's upper bound (default: -k)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} new tokens, "
          f"temperature {args.temperature}, fixed k={args.k}, adaptive K={args.adaptive_k or args.k}, {args.repeats} runs per engine")
    table = []
    for batch in map(int, args.batches.split(",")):
        s = row(batch, args)
        # Ratios per run: the three engines of one run shared the machine's load of that moment.
        vs_fixed = [a / f for a, f in zip(s["adaptive"], s["fixed"])]
        vs_plain = [a / p for a, p in zip(s["adaptive"], s["plain"])]
        table.append((batch, s, vs_fixed, vs_plain))
    print(f"\n| batch | {'plain tok/s min/med/max':^25} | {'fixed k tok/s':^25} | {'adaptive tok/s':^25} "
          f"| adaptive/fixed min/med/max | adaptive/plain min/med/max |")
    print("|---|---|---|---|---|---|")
    for batch, s, vs_fixed, vs_plain in table:
        print(f"| {batch:5} | {spread(s['plain'])} | {spread(s['fixed'])} | {spread(s['adaptive'])} | "
              f"{min(vs_fixed):.2f} / {statistics.median(vs_fixed):.2f} / {max(vs_fixed):.2f} | "
              f"{min(vs_plain):.2f} / {statistics.median(vs_plain):.2f} / {max(vs_plain):.2f} |")


if __name__ == "__main__":
    main()
