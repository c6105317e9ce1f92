"""How close the profile's prediction is to the real peak under the heaviest load.

After start-up, every one of max_num_seqs requests runs to max_model_len with speculative
decoding on; the process's peak memory (VmHWM on CPU, NVML/torch on CUDA) is compared with
the ledger. Targets: measured peak <= budget; KV cache >= 90% of (budget - measured non-KV peak).
  python bench/profiler_accuracy.py [--max-model-len 512] [--max-num-seqs 8] [engine flags]
"""
from __future__ import annotations

import argparse
import time

from worker.cli import add_engine_flags, engine_config
from worker.engine.llm_engine import LLMEngine
from worker.engine.sampling_params import SamplingParams

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.set_defaults(max_model_len=512, max_num_seqs=8)
    args = ap.parse_args()
    engine = LLMEngine(engine_config(args))
    ledger, device, c = engine.ledger, engine.device, engine.config

    # Prompts of half the context; outputs fill the rest, so every sequence reaches max_model_len.
    prompt_len = c.max_model_len // 2
    vocab = engine.tokenizer.vocab_size
    prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(prompt_len)] for i in range(c.max_num_seqs)]
    params = SamplingParams(max_tokens=c.max_model_len - prompt_len, temperature=0.8, ignore_eos=True, seed=0)
    device.reset_peak()
    start = time.perf_counter()
    engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    peak = device.process_peak_bytes()

    kv = ledger.bytes_of("kv_cache")
    budget = ledger.budget_bytes
    non_kv_peak = peak - kv
    kv_share = kv / (budget - non_kv_peak) if budget > non_kv_peak else float("nan")
    print(f"device {device}; {c.max_num_seqs} sequences x {c.max_model_len} tokens, k={engine.k}, "
          f"{seconds:.1f} s, {engine.scheduler.num_preemptions} preemptions")
    print(f"| {'figure':38} | {'MiB':>10} |")
    print(f"|{'-' * 40}|{'-' * 12}|")
    for name, value in [("budget", budget), ("predicted peak (declared ledger)", ledger.declared_bytes),
                        ("measured peak process memory", peak), ("  of which KV cache", kv),
                        ("predicted non-KV", ledger.non_kv_bytes), ("measured non-KV peak", non_kv_peak),
                        ("KV waste: budget - measured peak", budget - peak)]:
        print(f"| {name:38} | {value / MiB:10.1f} |")
    print(f"measured peak / budget = {peak / budget:.3f} (target <= 1.000): "
          f"{'PASS' if peak <= budget else 'FAIL'}")
    print(f"KV / (budget - measured non-KV peak) = {kv_share:.3f} (target >= 0.900): "
          f"{'PASS' if kv_share >= 0.9 else 'FAIL'}")


if __name__ == "__main__":
    main()
