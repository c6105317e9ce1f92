"""Where a prefill step's time goes, and how serving's time splits between prefill and decode steps
under long prompts, on the shipped pair (CPU, float32); each against the prefill path before the
prefill attention kernel, measured in the same run.

    python bench/prefill.py [--context 1024] [--repeats 5] [--requests 12] [--budgets 2048,512]
                            [--serve-repeats 1] [--skip-serving]

Paths (PATHS): "ours", what serving runs: a prompt's chunk in one C call (decoder_layers.c) with
the prefill attention kernel; "ours, layers in torch": the same kernels called layer by layer from
Python, so that its time splits by kind of work; "before": the path before the kernel, a prompt
from position 0 through the layers in torch with SDPA, a chunk after cached tokens in one C call
with the decode attention kernel (or the layers in torch with a gather, a mask and SDPA where that
kernel's scratch is too small).

1. One step, split by what runs it: the target and the draft prefill --context uncached tokens (one
   row from position 0: a long unique prompt), and 40 new tokens after a cached --context-token
   prefix at 1 and 8 rows (a shared system prompt). Each kind of work is timed by wrapping the
   functions that do it: matmuls (every projection and the head), attention (SDPA, the context
   gather and mask, the in-place kernels), rope and cache writes, norms, a forward in one C call
   (worker/kernels/decoder_layers.c: its parts are not split), and the rest (embeddings,
   activations, batch layout, Python). The paths take turns within each repeat; a ratio is ours
   over before's time in the same repeat.
2. Attention alone, one layer of the target's shapes: the prefill kernel against what ran before it
   (SDPA over the row's own tokens from position 0; after a cached prefix, the decode kernel where
   its scratch suffices, and the context gather, mask and SDPA), each repeat timing every one.
3. Serving: the engine kept at 4 streams of unique --context-token prompts, 32 output tokens each,
   temperature 1.0, until --requests are done: the wall time of prefill steps and of decode steps,
   plain and with the draft (adaptive), at each --max-num-batched-tokens of --budgets, each path
   --serve-repeats times.

Medians of the repeats; the machine's other load shows in their min and max.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from vramledger.worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, EngineConfig
from vramledger.worker.engine import model_runner
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.kernels import paged_attention, prefill_attention, rotate_store
from vramledger.worker.models import attention, decoder_forward, llama

PATHS = ("ours", "ours, layers in torch", "before")
CPU = torch.device("cpu")

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
                   (paged_attention, "attend", "attention"), (prefill_attention, "attend", "attention"),
                   (llama, "read_context", "attention"),
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


@contextmanager
def on_path(name: str, engine: LLMEngine | None = None):
    """Prefill steps take the path named (PATHS); decode and verify steps are left as they are."""
    if name == "ours":
        yield
    elif name == "ours, layers in torch":
        models = list(engine.runner.models.values())
        fused = [m.fused_forward for m in models]
        for m in models:
            m.fused_forward = None
        try:
            yield
        finally:
            for m, f in zip(models, fused):
                m.fused_forward = f
    else:  # before: no batch is marked a prompt's, and one from position 0 is not a C call's
        build, runs_on = model_runner.build_paged_batch, decoder_forward.DecoderForward.runs_on

        def unmarked(*args, **kwargs):
            batch = build(*args, **kwargs)
            batch.prefill = False
            return batch

        model_runner.build_paged_batch = unmarked
        decoder_forward.DecoderForward.runs_on = lambda self, kv, batch: (
            not batch.from_start and runs_on(self, kv, batch))
        try:
            yield
        finally:
            model_runner.build_paged_batch, decoder_forward.DecoderForward.runs_on = build, runs_on


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def split_step(engine: LLMEngine, model: str, rows: int, new: int, cached: int, repeats: int) -> dict:
    """Per path: seconds of one forward (rows x new tokens after `cached` cached ones), the median
    split, and its ratio to before's time in the same repeat."""
    runner = engine.runner
    table = list(range(-(-(cached + new) // engine.config.block_size)))
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 2048, (new,), generator=gen).tolist() for _ in range(rows)]
    totals, parts = defaultdict(list), defaultdict(lambda: defaultdict(list))
    for _ in range(repeats + 1):
        for name in PATHS:
            split = Split()
            with on_path(name, engine), split.installed(engine):
                start = time.perf_counter()
                runner.forward(model, tokens, [cached] * rows, [table] * rows, 1 if model == "target" else 0,
                               prefill=True)
                total = time.perf_counter() - start
            totals[name].append(total)
            for kind in KINDS[:-1]:
                parts[name][kind].append(split.seconds[kind])
            parts[name]["rest"].append(total - sum(split.seconds.values()))
    out = {}
    for name in PATHS:  # the first repeat warms up
        times, before = totals[name][1:], totals["before"][1:]
        out[name] = {**spread(times), "ratio": spread([t / b for t, b in zip(times, before)]),
                     "parts": {k: statistics.median(v[1:]) for k, v in parts[name].items()}}
    return out


def attention_alone(engine: LLMEngine, rows: int, new: int, cached: int, repeats: int) -> dict:
    """Per way of attending: seconds of one layer's attention (the target's heads), and the
    prefill kernel's ratio to it in the same repeat."""
    attn = engine.runner.models["target"].model.layers[0].self_attn
    H, kvH, D, block = attn.num_heads, attn.num_kv_heads, attn.head_dim, engine.config.block_size
    gen = torch.Generator().manual_seed(0)
    blocks = -(-(cached + new) // block)
    cache = torch.randn(2, rows * blocks * block, kvH, D, generator=gen)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(rows)]
    batch = attention.build_paged_batch([[1] * new] * rows, [cached] * rows, tables, block, 1, CPU, prefill=True)
    q = torch.randn(rows, new, H, D, generator=gen)
    own = cache[:, batch.write_slots].view(2, rows, new, kvH, D).transpose(2, 3)  # [k/v, B, kvH, Q, D]
    buffers = [torch.empty(batch.gather_slots.numel(), kvH, D) for _ in range(2)]
    args = (batch.gather_slots, batch.positions, batch.context_lens, None)

    def gathered():
        keys, values = (llama.read_context(cache[i], batch.gather_slots, buffers[i]) for i in range(2))
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=batch.mask(None, q.dtype),
                                              enable_gqa=True)

    ways = {"prefill kernel": lambda: prefill_attention.attend(q, cache[0], cache[1], *args)}
    if cached == 0:
        ways["SDPA over its own tokens"] = lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), own[0], own[1], is_causal=True, enable_gqa=True)
    if paged_attention.runs_on(q, cache, batch.gather_slots.shape[1]):
        ways["decode kernel"] = lambda: paged_attention.attend(q, cache[0], cache[1], *args)
    ways["gather, mask and SDPA"] = gathered
    times = defaultdict(list)
    with torch.inference_mode():
        for _ in range(repeats + 1):
            for name, run in ways.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    kernel = times["prefill kernel"][1:]
    return {name: {**spread(t[1:]), "ratio": spread([k / o for k, o in zip(kernel, t[1:])])}
            for name, t in times.items()}


def serve_long_prompts(draft: bool, budget: int, context: int, requests: int, streams: int = 4) -> dict:
    """Prefill and decode seconds while `streams` streams of unique long prompts are kept going."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=DEFAULT_DRAFT_MODEL if draft else None,
                                    max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=budget))
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    kind, schedule = {}, engine.scheduler.schedule

    def schedule_and_note():
        batch = schedule()
        kind["prefill"] = batch is not None and bool(batch.prefill)  # a step with prompt chunks (and decode rows)
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
    parser.add_argument("--serve-repeats", type=int, default=1)
    parser.add_argument("--skip-serving", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=DEFAULT_DRAFT_MODEL, max_num_seqs=16,
                                    max_model_len=2048))
    print(f"\n1. one prefill step, median of {args.repeats} (min-max); share of the step by kind of work\n")
    print("| step, path | ms | over before's | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 3) + "|")
    c = args.context
    for model in ("target", "draft"):
        for rows, new, cached, what in ((1, c, 0, f"{c} new tokens"), (1, 40, c, f"40 new after {c} cached"),
                                        (8, 40, c, f"8 rows x 40 new after {c} cached")):
            for name, r in split_step(engine, model, rows, new, cached, args.repeats).items():
                shares = " | ".join(f"{100 * r['parts'][k] / r['median']:.0f}%" for k in KINDS)
                ms = {k: f"{1000 * r[k]:.1f}" for k in ("median", "min", "max")}
                ratio = {k: f"{r['ratio'][k]:.2f}" for k in ("median", "min", "max")}
                print(f"| {model}, {what}, {name} | {ms['median']} ({ms['min']}-{ms['max']}) | "
                      f"{ratio['median']} ({ratio['min']}-{ratio['max']}) | {shares} |")
    print(f"\n2. one layer's attention (the target's heads), median of {args.repeats} (min-max)\n")
    print("| step | attention | ms | prefill kernel over it |")
    print("|---|---|---|---|")
    for rows, new, cached, what in ((1, c, 0, f"{c} new tokens"), (1, 40, c, f"40 new after {c} cached"),
                                    (8, 40, c, f"8 rows x 40 new after {c} cached")):
        for name, r in attention_alone(engine, rows, new, cached, args.repeats).items():
            ms = {k: f"{1000 * r[k]:.2f}" for k in ("median", "min", "max")}
            ratio = {k: f"{r['ratio'][k]:.2f}" for k in ("median", "min", "max")}
            print(f"| {what} | {name} | {ms['median']} ({ms['min']}-{ms['max']}) | "
                  f"{ratio['median']} ({ratio['min']}-{ratio['max']}) |")
    del engine
    if args.skip_serving:
        return

    print(f"\n3. serving 4 streams of unique {c}-token prompts, 32 output tokens each, "
          f"{args.requests} requests; median of {args.serve_repeats} (min-max)\n")
    print("| engine, path | --max-num-batched-tokens | prefill s (steps) | decode s (steps) | prefill share "
          "| prompt tok/s in prefill | output tok/s |")
    print("|---" * 7 + "|")
    for draft in (False, True):
        for budget in args.budgets:
            runs = defaultdict(list)
            for _ in range(args.serve_repeats):
                for name in ("ours", "before"):
                    with on_path(name):
                        runs[name].append(serve_long_prompts(draft, budget, c, args.requests))
            for name, rs in runs.items():
                def shown(values, digits):
                    v = spread(values)
                    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"
                prefill = [r["seconds"]["prefill"] for r in rs]
                decode = [r["seconds"]["decode"] for r in rs]
                share = [100 * p / (p + d) for p, d in zip(prefill, decode)]
                print(f"| {'draft (adaptive)' if draft else 'plain'}, {name} | {budget} | {shown(prefill, 1)} "
                      f"({rs[0]['steps']['prefill']}) | {shown(decode, 1)} ({rs[0]['steps']['decode']}) | "
                      f"{shown(share, 0)}% | {shown([r['prompt_tok_s'] for r in rs], 0)} "
                      f"| {shown([r['tok_s'] for r in rs], 1)} |")


if __name__ == "__main__":
    main()
