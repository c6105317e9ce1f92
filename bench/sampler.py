"""The sampler's draw: one inverse-CDF draw per row against the exponential race it replaced, and a
plain step's sampling from logits: torch's ops against draw_tokens.c.

    python bench/sampler.py [--rows 1,16,80] [--vocab 2048]

Both draws take a token from each row of a [rows, vocab] probability matrix: the race divides by
one Exp(1) draw per vocabulary entry and takes the argmax; inverse_cdf draws one uniform per row
and searches the cumulative sum. 80 rows is a verify step of 16 sequences at k=4. A plain step
starts from logits at temperature 1.0: `sample(probabilities(...))` (divide, softmax, cumsum,
search) against `draw` (one C call where the CPU has AVX-512 or AVX2), with glibc's mmap threshold pinned
as the worker pins it. Calls alternate; prints min/median/max microseconds per call and the ratio
of medians.
"""
from __future__ import annotations

import argparse

import torch
from alternating import alternate, ratio, spread

from vramledger.worker.engine.sampler import RowParams, draw, inverse_cdf, probabilities, sample
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.kernels import draw_tokens
from vramledger.worker.memory.device import fix_mmap_threshold


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,80")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7, help="timed blocks of 50 calls per method")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread, vocab {args.vocab}")
    for rows in map(int, args.rows.split(",")):
        probs = torch.randn(rows, args.vocab, generator=gen).softmax(-1)
        methods = {
            "exponential race": lambda: (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(-1),
            "inverse CDF": lambda: inverse_cdf(probs, torch.rand(rows, 1, generator=gen)),
        }
        times = alternate(methods, args.repeats, calls=50)
        race, cdf = times["exponential race"], times["inverse CDF"]
        print(f"{rows:3} rows: race {spread(race)} us | inverse CDF {spread(cdf)} us | {ratio(race, cdf):.1f}x",
              flush=True)
    if not draw_tokens.available():
        print("draw_tokens.c cannot run here (neither AVX-512 nor AVX2, or no C compiler): plain steps use torch's ops")
        return
    fix_mmap_threshold()  # as the worker runs on the CPU: a fresh buffer of 256 KiB or more faults its pages in
    for rows in map(int, args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=gen) * 3
        params = RowParams([SamplingParams(temperature=1.0)] * rows, [None] * rows, torch.device("cpu"))
        times = alternate({"torch": lambda: sample(probabilities(logits, params), params),
                           "kernel": lambda: draw(logits, params)}, args.repeats, calls=50)
        print(f"{rows:3} rows from logits: torch ops {spread(times['torch'])} us | draw_tokens.c "
              f"{spread(times['kernel'])} us | {ratio(times['torch'], times['kernel']):.1f}x", flush=True)


if __name__ == "__main__":
    main()
