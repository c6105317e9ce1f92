"""What publishing the engine's snapshot costs a step: one publication against one decode step.

    python bench/snapshot_cost.py [--batch 16] [--repeats 10] [--calls 20]

Builds the engine on the shipped pair (with the draft), starts --batch requests, then times
`publish_snapshot()` and `step()` with calls alternating (bench/alternating.py), every step still
decoding all of them. A step publishes once, so the share printed is what the snapshot adds to it.
"""
from __future__ import annotations

import argparse
import statistics

from alternating import alternate, ratio

PROMPT = "def fibonacci(n):\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()

    from vramledger.worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, EngineConfig
    from vramledger.worker.engine.llm_engine import LLMEngine
    from vramledger.worker.engine.sampling_params import SamplingParams

    steps = args.repeats * args.calls
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=DEFAULT_DRAFT_MODEL,
                                    max_num_seqs=args.batch, max_model_len=steps * 5 + 64))
    params = SamplingParams(max_tokens=steps * 5, temperature=0, ignore_eos=True)  # a step emits at most 5
    for _ in range(args.batch):
        engine.add_request(PROMPT, params)
    for _ in range(3):  # prefill, then decode steps: every request runs
        engine.step()
    times = alternate({"publish": engine.publish_snapshot, "step": engine.step}, args.repeats, args.calls)
    running = engine.snapshot.requests_running
    print(f"batch {args.batch} (running at the end: {running}), us per call, min median max")
    for name, values in times.items():
        print(f"{name:8} {min(values):9.1f} {statistics.median(values):9.1f} {max(values):9.1f}")
    print(f"publication / step: {100 / ratio(times['step'], times['publish']):.2g}% of a step")


if __name__ == "__main__":
    main()
