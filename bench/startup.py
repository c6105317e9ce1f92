"""Time to ready: `python -m vramledger.worker serve` started afresh N times, each timed from the moment its process is
started to its first GET /health 200. Prints each start's seconds, min / median / max over the runs and
min / median / max of each start-up phase the worker published (vramledger_startup_seconds). With
--peer vllm, vLLM's CPU build serving the same target is started as many times in the same run, the two
alternating, and the ratio of the medians is printed (ours / vLLM's).

  python bench/startup.py [--runs 5] [--pair shipped|big] [--peer vllm] [serve flags]

--pair big serves the large random Qwen2-shaped pair `selfcheck --scale large` builds (a 1.5 GB bf16
target and its draft, built once into ~/.cache/vramledger/selfcheck), at --max-model-len 2048 as vLLM
is started. Serve flags pass through to every worker (the shipped pair when none is given). The kernels are
built once per machine (~/.cache/vramledger/kernels): run the worker once before timing a fresh machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_peer import STARTUP_TIMEOUT, vllm_command  # noqa: E402

VLLM_MAX_MODEL_LEN = 2048  # vllm_command's default

from vramledger.worker.config import DEFAULT_MODEL  # noqa: E402
from vramledger.worker.selfcheck.processes import stop_group  # noqa: E402

POLL_S = 0.05  # /health is asked this often: the figure's resolution


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(cmd: list[str], url: str, log: Path, env: dict | None = None,
                  timeout: float = STARTUP_TIMEOUT) -> tuple[float, str]:
    """Seconds from starting `cmd` to its first /health 200, and its /metrics then; the process is stopped."""
    with open(log, "w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    ready = time.perf_counter() - started
                    break
            except httpx.HTTPError:
                pass  # not listening yet
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"{cmd[:4]} not ready after {timeout} s; see {log}")
            time.sleep(POLL_S)
        return ready, httpx.get(url + "/metrics", timeout=10).text
    finally:
        stop_group(proc, 60, cmd[0])


def phases(metrics: str) -> dict[str, float]:
    """{phase: seconds} of vramledger_startup_seconds in a text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["phase"]: s.value for family in text_string_to_metric_families(metrics)
            for s in family.samples if s.name == "vramledger_startup_seconds"}


def spread(values: list[float]) -> str:
    return f"{min(values):6.2f} {statistics.median(values):7.2f} {max(values):6.2f}"


def served_model(serve_flags: list[str]) -> str:
    return serve_flags[serve_flags.index("--model") + 1] if "--model" in serve_flags else DEFAULT_MODEL


def pair_flags(pair: str) -> list[str]:
    """The serve flags of a named pair: none for the shipped one; the large random pair, built once."""
    if pair == "shipped":
        return []
    from vramledger.worker.selfcheck.run import large_models

    target, draft = large_models(None, "cpu")
    return ["--model", str(target), "--draft-model", str(draft), "--max-model-len", str(VLLM_MAX_MODEL_LEN)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="fresh starts of each server (default 5)")
    ap.add_argument("--pair", choices=("shipped", "big"), default="shipped",
                    help="the shipped pair (default), or the large random Qwen2-shaped pair (built once)")
    ap.add_argument("--peer", choices=("vllm",), default=None,
                    help="also start vLLM's CPU build on the same target, alternating with ours")
    ap.add_argument("--timeout", type=float, default=STARTUP_TIMEOUT,
                    help=f"seconds a start may take before the bench gives up (default {STARTUP_TIMEOUT})")
    ap.add_argument("--logdir", type=Path, default=Path("/tmp/vramledger-startup"),
                    help="each start's log (default /tmp/vramledger-startup)")
    args, serve_flags = ap.parse_known_args()
    serve_flags = [*pair_flags(args.pair), *serve_flags]
    args.logdir.mkdir(parents=True, exist_ok=True)
    ours: list[float] = []
    theirs: list[float] = []
    per_phase: dict[str, list[float]] = {}
    for i in range(1, args.runs + 1):
        port = free_port()
        cmd = [sys.executable, "-m", "vramledger.worker", "serve", "--port", str(port), *serve_flags]
        seconds, metrics = time_to_ready(cmd, f"http://127.0.0.1:{port}", args.logdir / f"worker-{i}.log",
                                         timeout=args.timeout)
        ours.append(seconds)
        published = phases(metrics)
        for phase, value in published.items():
            per_phase.setdefault(phase, []).append(value)
        line = f"run {i}: worker ready in {seconds:.2f} s (" + ", ".join(
            f"{phase} {value:.2f}" for phase, value in published.items()) + ")"
        if args.peer == "vllm":
            port = free_port()
            cmd = vllm_command(served_model(serve_flags), port, max_model_len=VLLM_MAX_MODEL_LEN)
            seconds, _ = time_to_ready(cmd, f"http://127.0.0.1:{port}", args.logdir / f"vllm-{i}.log",
                                       env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=args.timeout)
            theirs.append(seconds)
            line += f", vLLM in {seconds:.2f} s"
        print(line, flush=True)
    print(f"\n{args.runs} starts of {served_model(serve_flags)} (seconds: min median max)")
    print(f"{'worker, to /health 200':32} {spread(ours)}")
    for phase, values in per_phase.items():
        print(f"{'  phase ' + phase:32} {spread(values)}")
    if theirs:
        print(f"{'vLLM CPU, to /health 200':32} {spread(theirs)}")
        print(f"{'worker / vLLM, each run':32} {spread([a / b for a, b in zip(ours, theirs)])}")
        print(f"median worker / median vLLM: {statistics.median(ours) / statistics.median(theirs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
