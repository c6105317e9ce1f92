"""Where a prefill step's time goes, and how serving's time splits between prefill and decode steps
under long prompts, on the shipped pair (CPU, float32).

    python bench/prefill.py [--context 1024] [--repeats 5] [--requests 12] [--budgets 2048,512]

1. One step, split by what runs it: the target and the draft prefill --context uncached tokens (one
   row from position 0: a long unique prompt), and 40 new tokens after a cached --context-token
   prefix at 1 and 8 rows (a shared system prompt). Each kind of work is timed by wrapping the
   functions that do it: matmuls (every projection and the head), attention (SDPA, the context
   gather and mask, the in-place kernel), rope and cache writes, norms, a decode-style forward in
   one C call (worker/kernels/decoder_layers.c: its parts are not split), and the rest
   (embeddings, activations, batch layout, Python).
2. Serving: the engine kept at 4 streams of unique --context-token prompts, 32 output tokens each,
   temperature 1.0, until --requests are done: the wall time of prefill steps and of decode steps,
   plain and with the draft (adaptive), at each --max-num-batched-tokens of --budgets.

Medians of --repeats (part 1); the machine's other load shows in their min and max.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams
from worker.kernels import paged_attention, rotate_store
from worker.models import attention, decoder_forward, llama

KINDS = ("matmul", "attention", "rope + cache write", "norm", "forward in one C call", "rest")


class Split:
    """Seconds per kind of work, added up by wrappers around the functions that do it."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, kind: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start

        setattr(owner, name, timed)

    @contextmanager
    def installed(self, engine: LLMEngine):
        targets = [(llama, "linear", "matmul"), (F, "scaled_dot_product_attention", "attention"),
                   (paged_attention, "attend", "attention"), (llama, "read_context", "attention"),
                   (attention.PagedBatch, "mask", "attention"),
                   (rotate_store, "rotate_store", "rope + cache write"),
                   (llama, "rotate_", "rope + cache write"),
                   (llama.RMSNorm, "forward", "norm"),
                   (decoder_forward.DecoderForward, "__call__", "forward in one C call")]
        targets += [(m.self_attn, "write_kv", "rope + cache write")
                    for model in engine.runner.models.values() for m in model.model.layers]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        for owner, name, kind in targets:
            self.wrap(owner, name, kind)
        try:
            yield self
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)


def split_step(engine: LLMEngine, model: str, rows: int, new: int, cached: int, repeats: int) -> dict:
    """Median seconds of one forward (rows x new tokens after `cached` cached ones) and its split."""
    runner = engine.runner
    table = list(range(-(-(cached + new) // engine.config.block_size)))
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 2048, (new,), generator=gen).tolist() for _ in range(rows)]
    totals, parts = [], defaultdict(list)
    for _ in range(repeats + 1):
        split = Split()
        with split.installed(engine):
            start = time.perf_counter()
            runner.forward(model, tokens, [cached] * rows, [table] * rows, 1 if model == "target" else 0)
            total = time.perf_counter() - start
        totals.append(total)
        for kind in KINDS[:-1]:
            parts[kind].append(split.seconds[kind])
        parts["rest"].append(total - sum(split.seconds.values()))
    totals, parts = totals[1:], {k: v[1:] for k, v in parts.items()}  # the first run warms up
    return {"median": statistics.median(totals), "min": min(totals), "max": max(totals),
            "parts": {k: statistics.median(v) for k, v in parts.items()}}


def serve_long_prompts(draft: bool, budget: int, context: int, requests: int, streams: int = 4) -> dict:
    """Prefill and decode seconds while `streams` streams of unique long prompts are kept going."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=DEFAULT_DRAFT_MODEL if draft else None,
                                    max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=budget))
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    kind, schedule = {}, engine.scheduler.schedule

    def schedule_and_note():
        batch = schedule()
        kind["prefill"] = batch is not None and batch.is_prefill
        return batch

    engine.scheduler.schedule = schedule_and_note
    seconds = {"prefill": 0.0, "decode": 0.0}
    steps = {"prefill": 0, "decode": 0}
    sent = done = generated = 0
    started = time.perf_counter()
    while done < requests:
        while sent < requests and sent - done < streams:
            engine.add_request(torch.randint(0, 2048, (context,), generator=gen).tolist(), params)
            sent += 1
        start = time.perf_counter()
        outputs = engine.step()
        which = "prefill" if kind["prefill"] else "decode"
        seconds[which] += time.perf_counter() - start
        steps[which] += 1
        generated += sum(len(o.new_token_ids) for o in outputs)
        done += sum(o.finished for o in outputs)
    wall = time.perf_counter() - started
    return {"seconds": seconds, "steps": steps, "wall": wall, "tok_s": generated / wall,
            "prompt_tok_s": requests * context / seconds["prefill"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--budgets", default="2048,512", type=lambda s: [int(x) for x in s.split(",")])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=DEFAULT_DRAFT_MODEL, max_num_seqs=16,
                                    max_model_len=2048))
    print(f"\n1. one prefill step, median of {args.repeats} (min-max); share of the step by kind of work\n")
    print("| step | ms | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 2) + "|")
    c = args.context
    for model in ("target", "draft"):
        for rows, new, cached, what in ((1, c, 0, f"{c} new tokens"), (1, 40, c, f"40 new after {c} cached"),
                                        (8, 40, c, f"8 rows x 40 new after {c} cached")):
            r = split_step(engine, model, rows, new, cached, args.repeats)
            shares = " | ".join(f"{100 * r['parts'][k] / r['median']:.0f}%" for k in KINDS)
            ms = {k: f"{1000 * r[k]:.0f}" for k in ("median", "min", "max")}
            print(f"| {model}, {what} | {ms['median']} ({ms['min']}-{ms['max']}) | {shares} |")
    del engine

    print(f"\n2. serving 4 streams of unique {c}-token prompts, 32 output tokens each, "
          f"{args.requests} requests\n")
    print("| engine | --max-num-batched-tokens | prefill s (steps) | decode s (steps) | prefill share "
          "| prompt tok/s in prefill | output tok/s |")
    print("|---" * 7 + "|")
    for draft in (False, True):
        for budget in args.budgets:
            r = serve_long_prompts(draft, budget, c, args.requests)
            total = r["seconds"]["prefill"] + r["seconds"]["decode"]
            seconds, steps = r["seconds"], r["steps"]
            print(f"| {'draft (adaptive)' if draft else 'plain'} | {budget} | {seconds['prefill']:.1f} "
                  f"({steps['prefill']}) | {seconds['decode']:.1f} ({steps['decode']}) | "
                  f"{100 * seconds['prefill'] / total:.0f}% | {r['prompt_tok_s']:.0f} | {r['tok_s']:.1f} |")


if __name__ == "__main__":
    main()
