"""Engine decode throughput of this tree against another git revision, measured in the same run.

    python bench/engine_step.py [--against main] [--runs 5] [--tokens 64] [--greedy]

Workloads: batch 1 and 16, plain and with the draft (k=4), temperature 1.0 as bench/serve.py's
clients ask (or --greedy). Every run is a fresh process that builds the engine on the shipped pair,
warms up with one generate() and times the next one; runs alternate between the two trees so
both see the same machine load. Prints min/median/max tokens/s per tree and the ratio of medians.
The other tree is `git archive REV`, unpacked in a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "    def __repr__(self):\n", "def parse_args(argv):\n    parser = ", "try:\n    import json\n",
           "for line in sys.stdin:\n", "def _check(value, name):\n    if not "] * 2
WORKLOADS = [(1, False), (1, True), (16, False), (16, True)]  # (batch, with the draft)


def one_run(batch: int, draft: bool, tokens: int, greedy: bool) -> dict:
    """In the child process: tokens/s of one timed generate() after a warm-up."""
    import vramledger.worker as worker
    from vramledger.worker.config import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL, EngineConfig
    from vramledger.worker.engine.llm_engine import LLMEngine
    from vramledger.worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, draft_model=DEFAULT_DRAFT_MODEL if draft else None,
                                    max_num_seqs=16, max_model_len=512))
    params = SamplingParams(max_tokens=tokens, temperature=0 if greedy else 1.0, ignore_eos=True, seed=0)
    engine.generate(PROMPTS[:batch], params)
    start = time.perf_counter()
    engine.generate(PROMPTS[:batch], params)
    seconds = time.perf_counter() - start
    return {"tok_s": batch * tokens / seconds, "source": worker.__file__}


def spawn(tree: Path, batch: int, draft: bool, tokens: int, greedy: bool) -> float:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{batch},{int(draft)}",
           "--tokens", str(tokens)] + (["--greedy"] if greedy else [])
    env = {**os.environ, "PYTHONPATH": str(tree), "TQDM_DISABLE": "1"}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["source"].startswith(str(tree)):
        raise RuntimeError(f"the run for {tree} imported {result['source']}")
    return result["tok_s"]


def unpack(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def spread(values: list[float]) -> str:
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="main", help="git revision to compare with")
    ap.add_argument("--runs", type=int, default=5, help="timed processes per tree and workload")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--greedy", action="store_true", help="temperature 0 instead of 1.0")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        batch, draft = map(int, args.child.split(","))
        print(json.dumps(one_run(batch, bool(draft), args.tokens, args.greedy)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT, args.against: unpack(args.against, Path(tmp))}
        print(f"{args.tokens} new tokens per request, {'greedy' if args.greedy else 'temperature 1.0'}, "
              f"{args.runs} runs per tree, alternating; tokens/s min median max")
        print(f"| {'workload':18} | {'this tree':>23} | {args.against:>23} | ratio of medians |")
        for batch, draft in WORKLOADS:
            results = {name: [] for name in trees}
            for _ in range(args.runs):
                for name, tree in trees.items():
                    results[name].append(spawn(tree, batch, draft, args.tokens, args.greedy))
            ours, theirs = results["this tree"], results[args.against]
            name = f"batch {batch}, {'draft k=4' if draft else 'plain'}"
            print(f"| {name:18} | {spread(ours):>23} | {spread(theirs):>23} | "
                  f"{statistics.median(ours) / statistics.median(theirs):15.2f}x |", flush=True)


if __name__ == "__main__":
    main()
