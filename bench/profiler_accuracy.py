"""How close the profile's prediction is to the real peak under the heaviest load.

Engine mode (default): after start-up, every one of max_num_seqs requests runs to max_model_len
with speculative sampling; the process's peak memory (VmHWM on CPU, NVML/torch on CUDA) is
compared with the ledger. HTTP mode (--http): the worker runs under `python -m vramledger.worker serve`
and is loaded through its API with more requests than the KV cache holds, until requests are
preempted; the worker's RSS is sampled from outside (psutil, every 2 ms) against its budget.
Each run is a fresh process; --runs N prints min / median / max.
Targets: measured peak <= budget in every run; median KV cache share of
(budget - measured non-KV peak) >= 0.95.
  python bench/profiler_accuracy.py [--runs 20] [--max-model-len 512] [--max-num-seqs 8] [engine flags]
  python bench/profiler_accuracy.py --goals [--jobs 2]   # the two accuracy goals, in one command
  python bench/profiler_accuracy.py --http [--runs 5] [--requests 32] [--kv-cache-memory 16MiB] [engine flags]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vramledger.worker.cli import add_engine_flags, add_waiting_flag, engine_config
from vramledger.worker.selfcheck.processes import free_port, stop_group, wait_http

MiB = 1 << 20
KV_SHARE_TARGET = 0.95
# The accuracy goals: 20 engine runs, 0 overruns and median KV share >= 0.95; 5 HTTP runs to full KV, 0 overruns.
GOAL_ENGINE = ("--runs", "20", "--max-model-len", "2048", "--max-num-seqs", "16")
GOAL_HTTP = ("--http", "--runs", "5", "--max-model-len", "256", "--max-num-seqs", "16", "--kv-cache-memory", "20MiB")


def kv_share(kv: int, budget: int, peak: int) -> float:
    """KV cache / (budget - measured non-KV peak): 1.0 when the prediction is exact."""
    non_kv_peak = peak - kv
    return kv / (budget - non_kv_peak) if budget > non_kv_peak else float("nan")


# --- one engine run, in this process ---
def engine_run(args) -> dict:
    from vramledger.worker.engine.llm_engine import LLMEngine
    from vramledger.worker.engine.sampling_params import SamplingParams

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
    return dict(seconds=time.perf_counter() - start, peak=device.process_peak_bytes(),
                budget=ledger.budget_bytes, kv=ledger.bytes_of("kv_cache"), declared=ledger.declared_bytes,
                entries={e.component + (f"[{e.model}]" if e.model else ""): e.bytes for e in ledger.entries},
                preemptions=engine.scheduler.num_preemptions, device=str(device))


# --- one HTTP run: a worker process, loaded from here ---
class RssSampler:
    """Peak RSS of another process, polled in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.002):
        import psutil

        self.process, self.interval_s, self.peak = psutil.Process(pid), interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except Exception:
                return
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def http_run(args, engine_flags: list[str]) -> dict:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "vramledger.worker", "serve", "--port", str(port), "--log-level", "WARNING",
           *engine_flags]
    fd, log = tempfile.mkstemp(prefix="profiler-accuracy-worker-", suffix=".log")
    worker = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=fd)
    os.close(fd)  # the child keeps its own descriptor
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", 600, worker, Path(log))
        with httpx.Client(base_url=base, timeout=600) as client:
            memory = client.get("/v1/memory").json()
            model = client.get("/v1/models").json()["data"][0]["id"]
            max_model_len = args.max_model_len
            prompt_len = max_model_len // 2

            def body(i: int) -> dict:
                return {"model": model, "prompt": [(7 * i + j) % 255 + 1 for j in range(prompt_len)],
                        "max_tokens": max_model_len - prompt_len, "temperature": 0.8, "ignore_eos": True,
                        "seed": i}

            start = time.perf_counter()
            with RssSampler(worker.pid) as sampler, ThreadPoolExecutor(args.requests) as pool:
                results = list(pool.map(lambda i: client.post("/v1/completions", json=body(i)).status_code,
                                        range(args.requests)))
                final = client.get("/v1/memory").json()
            metrics = client.get("/metrics").text
        return dict(seconds=time.perf_counter() - start, peak=sampler.peak, budget=memory["budget"]["bytes"],
                    kv=next(e["bytes"] for e in memory["entries"] if e["component"] == "kv_cache"),
                    declared=memory["declared_bytes"],
                    entries={e["component"] + (f"[{e['model']}]" if e["model"] else ""): e["bytes"]
                             for e in memory["entries"]},
                    preemptions=int(metric(metrics, "vramledger_preemptions_total")),
                    failed=sum(r != 200 for r in results), live=final["live"]["process_bytes"],
                    device=memory["device"]["kind"])
    finally:
        stop_group(worker, 30, "worker")
        os.unlink(log)


# --- reports ---
def print_run(i: int, r: dict) -> None:
    share = kv_share(r["kv"], r["budget"], r["peak"])
    print(f"run {i}: peak/budget {r['peak'] / r['budget']:.3f}, KV share {share:.3f}, "
          f"peak {r['peak'] / MiB:.1f} MiB of {r['budget'] / MiB:.1f} MiB, KV {r['kv'] / MiB:.1f} MiB, "
          f"{r['preemptions']} preemptions, {r['seconds']:.0f} s"
          + (f", {r['failed']} failed requests" if r.get("failed") else ""), flush=True)


def print_summary(runs: list[dict], mode: str) -> bool:
    ratios = [r["peak"] / r["budget"] for r in runs]
    shares = [kv_share(r["kv"], r["budget"], r["peak"]) for r in runs]
    overruns = sum(r["peak"] > r["budget"] for r in runs)
    first = runs[0]
    print(f"\n{mode} mode, {len(runs)} runs on {first['device']}; ledger of run 1 (MiB): "
          + ", ".join(f"{k} {v / MiB:.1f}" for k, v in first["entries"].items()))
    print(f"| {'figure':28} | {'min':>7} | {'median':>7} | {'max':>7} |")
    print(f"|{'-' * 30}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for name, values in (("measured peak / budget", ratios), ("KV share", shares),
                         ("budget - peak (MiB)", [(r["budget"] - r["peak"]) / MiB for r in runs]),
                         ("preemptions", [r["preemptions"] for r in runs])):
        print(f"| {name:28} | {min(values):7.3f} | {statistics.median(values):7.3f} | {max(values):7.3f} |")
    median_share = statistics.median(shares)
    print(f"overruns (peak > budget): {overruns} of {len(runs)}: {'PASS' if overruns == 0 else 'FAIL'}")
    if mode == "HTTP":  # the KV cache is set smaller than the load on purpose: only overruns count
        if not all(r["preemptions"] for r in runs):
            print("WARNING: some runs had no preemption: lower --kv-cache-memory or raise --requests")
        return overruns == 0
    print(f"median KV share {median_share:.3f} (target >= {KV_SHARE_TARGET}): "
          f"{'PASS' if median_share >= KV_SHARE_TARGET else 'FAIL'}")
    return overruns == 0 and median_share >= KV_SHARE_TARGET


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.set_defaults(max_model_len=512, max_num_seqs=8)
    ap.add_argument("--runs", type=int, default=1, help="fresh processes, one run each")
    ap.add_argument("--jobs", type=int, default=1, help="engine mode: runs at once (each its own process)")
    ap.add_argument("--http", action="store_true", help="load a `serve` worker through its API")
    ap.add_argument("--requests", type=int, default=None,
                    help="HTTP mode: concurrent requests (default 3 x max_num_seqs)")
    add_waiting_flag(ap)
    ap.set_defaults(max_waiting=None)  # HTTP mode: every request may wait (none refused)
    ap.add_argument("--goals", action="store_true",
                    help="the accuracy goals in one command: engine mode, " + " ".join(GOAL_ENGINE)
                         + "; then HTTP mode, " + " ".join(GOAL_HTTP) + " (other flags pass through)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run, JSON out
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(engine_run(args)), flush=True)
        return
    if not args.goals:
        sys.exit(0 if run_mode(args, sys.argv[1:]) else 1)
    # The engine goal where the KV cache is most of the budget (2048 tokens x 16 sequences); the HTTP goal
    # with a KV cache far smaller than the load, so that requests are preempted.
    given = [a for a in sys.argv[1:] if a != "--goals"]
    verdicts = {}
    for mode, recipe in (("engine", GOAL_ENGINE), ("HTTP", GOAL_HTTP)):
        argv = [*given, *recipe]  # the recipe's flags come last and win
        verdicts[mode] = run_mode(ap.parse_args(argv), argv)
    print("\ngoals: " + ", ".join(f"{m} {'PASS' if ok else 'FAIL'}" for m, ok in verdicts.items()))
    sys.exit(0 if all(verdicts.values()) else 1)


def run_mode(args, argv: list[str]) -> bool:
    """args.runs runs of one mode; argv holds the engine flags (this script's own are removed)."""
    argv = [a for a in argv if a != "--http"]
    for name in ("--runs", "--jobs", "--requests", "--max-waiting"):
        argv = strip_option(argv, name)
    args.requests = args.requests or 3 * args.max_num_seqs
    if args.max_waiting is None:  # a full KV cache runs fewer than max_num_seqs: all may wait
        args.max_waiting = args.requests
    if args.http:
        run = lambda i: http_run(args, [*with_lengths(argv, args), "--max-waiting", str(args.max_waiting)])  # noqa: E731
    else:
        run = lambda i: engine_child(i, argv)  # noqa: E731
    results = []
    with ThreadPoolExecutor(1 if args.http else args.jobs) as pool:
        for i, result in enumerate(pool.map(run, range(1, args.runs + 1)), 1):
            results.append(result)
            print_run(i, result)
    return print_summary(results, "HTTP" if args.http else "engine")


def engine_child(i: int, argv: list[str]) -> dict:
    child = subprocess.run([sys.executable, __file__, "--one", *argv], capture_output=True, text=True)
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    if child.returncode != 0 or not lines:
        sys.exit(f"run {i} failed:\n{child.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def strip_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def with_lengths(argv: list[str], args) -> list[str]:
    """The engine flags for `serve`, with this script's defaults made explicit."""
    given = {a.split("=")[0] for a in argv}
    return [*argv, *(["--max-model-len", str(args.max_model_len)] if "--max-model-len" not in given else []),
            *(["--max-num-seqs", str(args.max_num_seqs)] if "--max-num-seqs" not in given else [])]


if __name__ == "__main__":
    main()
