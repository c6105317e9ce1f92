"""Where the draft costs when it does not pay: serve.py's loads in the engine alone, plain vs with the
draft (adaptive k), closed-loop streams, engines alternating in one process.

    python bench/draft_cost.py [--loads short-1,short-16,shared-prefix,long-prompt] [--rounds 3]
                               [--requests-per-stream 3] [--cpu-threads 1]

Each stream sends its next request as soon as its last one finishes (temperature 1.0, ignore_eos,
prompts cut from this repository's docs, as guidellm's synthetic text is real text). Per load and
round, the two engines in alternating order: output tokens per second of wall time and per second of
this process's CPU time (a shared host's other work slows the first, hardly the second) and their
ratios; for the draft engine, the seconds its forwards took by kind (the draft's prefill beside the
target's, where a tree still runs one; its catch-up; its proposals; the target's plain or mixed
steps and verifications) and the decode steps' k. Both engines stay up across rounds (as servers
do), each load warmed up once. Run it with PYTHONPATH set to another tree to measure that tree.
Timings only: nothing here is a test.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections import Counter
from pathlib import Path

from vramledger.worker.config import EngineConfig
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
# name: (streams, prompt tokens, output tokens, shared prefix tokens), bench/serve.py's loads
LOADS = {"short-1": (1, 32, 128, 0), "short-16": (16, 32, 128, 0), "shared-prefix": (8, 32, 32, 1024),
         "long-prompt": (4, 1024, 32, 0)}


class ForwardTimes:
    """Seconds and calls of each model's forwards by kind, wrapped around the engine's runner."""

    def __init__(self, engine: LLMEngine):
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self.ks: Counter = Counter()
        runner, policy = engine.runner, engine.speculation
        forward, parts, start_step = runner.forward, runner.forward_parts, policy.start_step

        inside = [False]  # forward_parts of one part calls forward: counted once

        def timed(kind, fn, *args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            t, inside[0] = time.perf_counter(), True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
                self.seconds[kind] += time.perf_counter() - t
                self.calls[kind] += 1

        def forward_kind(name, *args, **kwargs):
            if name == "target":
                kind = "target verify"
            elif kwargs.get("prefill"):
                kind = "draft catch-up" if engine._draft_catching_up else "draft prefill"
            else:
                kind = "draft propose"
            return timed(kind, forward, name, *args, **kwargs)

        def start(*args, **kwargs):
            k = start_step(*args, **kwargs)
            self.ks[k] += 1
            return k
        runner.forward = forward_kind
        runner.forward_parts = lambda name, p: timed(f"{name} plain/mixed", parts, name, p)
        policy.start_step = start
        engine._draft_catching_up = False
        step = engine.speculative_step
        catch_up = step.catch_up

        def flagged(seqs, policy):
            engine._draft_catching_up = True
            try:
                return catch_up(seqs, policy)
            finally:
                engine._draft_catching_up = False
        step.catch_up = flagged

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.ks.clear()


def corpus(engine: LLMEngine) -> list[int]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    return engine.tokenizer.encode(text)


def drive(engine: LLMEngine, tokens: list[int], load: tuple[int, int, int, int], requests_per_stream: int,
          offset: int) -> tuple[float, float]:
    """Output tokens per second of wall time and per second of this process's CPU time (the machine's
    other work slows the first, hardly the second), closed-loop streams through one load."""
    streams, prompt, output, prefix = load
    params = SamplingParams(max_tokens=output, temperature=1.0, ignore_eos=True)
    cuts = itertools.count(offset)
    shared = tokens[:prefix]

    def next_prompt() -> list[int]:
        at = (next(cuts) * 97 * prompt + prefix) % (len(tokens) - prompt)
        return shared + tokens[at:at + prompt]
    left = streams * requests_per_stream
    for _ in range(streams):
        engine.add_request(next_prompt(), params)
    left -= streams
    made, start, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            made += len(out.new_token_ids)
            if out.finished and left:
                engine.add_request(next_prompt(), params)
                left -= 1
    return made / (time.perf_counter() - start), made / (time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default=",".join(LOADS), type=lambda s: s.split(","))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--cpu-threads", type=int, default=1, help="the engines' threads (the server's on 2 cores)")
    args = ap.parse_args()
    common = {"max_num_seqs": 32, "max_model_len": 2048, "cpu_threads": args.cpu_threads}
    engines = {"plain": LLMEngine(EngineConfig(draft_model=None, **common)),
               "draft": LLMEngine(EngineConfig(**common))}
    tokens = corpus(engines["plain"])
    times = ForwardTimes(engines["draft"])
    for name in args.loads:
        load = LOADS[name]
        for engine in engines.values():
            drive(engine, tokens, load, 1, 0)  # warm-up
        ratios, cpu_ratios = [], []
        print(f"\n{name}: {load[0]} streams, {load[1]}-token prompts"
              + (f" after a shared {load[3]}-token prefix" if load[3] else "") + f", {load[2]} output tokens")
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            speed, cpu = {}, {}
            for which in order:
                times.reset()
                speed[which], cpu[which] = drive(engines[which], tokens, load, args.requests_per_stream, 1000 * (r + 1))
                if which == "draft":
                    spent = ", ".join(f"{kind} {s:.3f} s/{times.calls[kind]}" for kind, s in
                                      sorted(times.seconds.items()))
                    ks = ", ".join(f"k={k}: {n}" for k, n in sorted(times.ks.items()))
                    drafted = spent
            ratios.append(speed["draft"] / speed["plain"])
            cpu_ratios.append(cpu["draft"] / cpu["plain"])
            print(f"  round {r + 1}: plain {speed['plain']:.0f} tok/s, draft {speed['draft']:.0f} tok/s, "
                  f"ratio {ratios[-1]:.2f} (per CPU second {cpu_ratios[-1]:.2f}); draft engine: {drafted}; "
                  f"decode steps {ks}", flush=True)
        for what, values in (("wall", ratios), ("CPU", cpu_ratios)):
            print(f"  ratio ({what}) min / median / max: {min(values):.2f} / {statistics.median(values):.2f}"
                  f" / {max(values):.2f}")


if __name__ == "__main__":
    main()
