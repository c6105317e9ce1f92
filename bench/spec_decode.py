"""Decode throughput on the shipped pair: ours (plain, speculative, batched) vs transformers.

Greedy, 128 new tokens per prompt, every row measured in this run on this machine:
  python bench/spec_decode.py [--tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from vramledger.worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "    def __repr__(self):\n", "def parse_args(argv):\n    parser = ", "try:\n    import json\n",
           "for line in sys.stdin:\n", "def _check(value, name):\n    if not "]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and lazy imports
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def ours(draft: str | None, batch: int, tokens: int, repeats: int) -> tuple[float, float | None]:
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=draft, max_num_seqs=max(batch, 1)))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    seconds = timed(lambda: engine.generate(PROMPTS[:batch], params), repeats)
    return batch * tokens / seconds, engine.stats.mean_acceptance_length if draft else None


def theirs(assisted: bool, batch: int, tokens: int, repeats: int) -> float:
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tok.padding_side = "left"
    target = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL).eval()
    extra = {"assistant_model": transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_DRAFT_MODEL).eval()} \
        if assisted else {}
    inputs = tok(PROMPTS[:batch], return_tensors="pt", padding=True)

    def run():
        with torch.inference_mode():
            target.generate(**inputs, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                            pad_token_id=tok.pad_token_id, **extra)
    return batch * tokens / timed(run, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, r = args.tokens, args.repeats
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, {n} new tokens, greedy, median of {r}")
    rows = []
    plain1, _ = ours(None, 1, n, r)
    spec1, mal1 = ours(DEFAULT_DRAFT_MODEL, 1, n, r)
    plain8, _ = ours(None, 8, n, r)
    spec8, mal8 = ours(DEFAULT_DRAFT_MODEL, 8, n, r)
    hf1 = theirs(False, 1, n, r)
    hf_assist1 = theirs(True, 1, n, r)
    hf8 = theirs(False, 8, n, r)
    rows = [
        ("batch 1, plain", plain1, hf1),
        ("batch 1, speculative (k=4)", spec1, hf_assist1),
        ("batch 8, plain", plain8, hf8),
        ("batch 8, speculative (k=4)", spec8, None),
    ]
    print(f"\n| {'workload':28} | {'ours tok/s':>10} | {'transformers tok/s':>18} | {'ours / transformers':>19} |")
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 20}|{'-' * 21}|")
    for name, o, t in rows:
        print(f"| {name:28} | {o:10.1f} | {'n/a' if t is None else f'{t:.1f}':>18} | "
              f"{'n/a' if t is None else f'{o / t:.2f}x':>19} |")
    print("\ntransformers' speculative row is generate(assistant_model=draft); it cannot batch (n/a).")
    print(f"ours speculative / ours plain: batch 1 {spec1 / plain1:.2f}x (target >= 1.5x), "
          f"batch 8 {spec8 / plain8:.2f}x")
    print(f"mean acceptance length: batch 1 {mal1:.2f}, batch 8 {mal8:.2f}")


if __name__ == "__main__":
    main()
