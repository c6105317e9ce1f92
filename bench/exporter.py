"""Exporter scrape latency (p50/p99) over real sockets, beside a bare prometheus_client server as the peer.

Modes, each a separate exporter process, scraped one request at a time:
  fleet   the host reader beside 8 vLLM servers (tests/vllm_tree.py: a real API server -> engine core
          -> rank process tree serving the /metrics text recorded from vLLM's CPU build) and 8 ledger
          workers (tests/ledger_worker.py), every one its own process on a real socket
  nvml    a fake NVML of 8 GPUs x 64 processes, one ledger worker; default --max-processes, and all
  host    the host reader on this machine, one ledger worker
  mixed   a node's worth of engines: the host reader beside 64 engines of every kind in turn (our
          workers, vLLM trees, and fake servers of the kinds that need a GPU, in their real shapes:
          bench/engine_fleet.py), each its own process on a real socket, under its kind's flag
Each mode runs --runs times (a fresh exporter each run); p50 and p99 are printed as min / median / max
over the runs, beside the exporter's own CPU time per scrape (less sensitive to a busy machine) and
its peak RSS over the run (VmHWM).

    python bench/exporter.py [--runs 5] [--scrapes 300] [--modes fleet,nvml,host,mixed]

Targets: p99 under 50 ms, fleet mode included; mixed mode, p99 under 100 ms and the exporter under
150 MiB.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a plain script: the repository's packages, installed or not
from engine_fleet import cpu_seconds, footprint, ledger_worker, serving, start_mixed, tree, vllm_server  # noqa: E402

from vramledger.worker.selfcheck.processes import ProcessExited, WaitTimedOut, wait_until  # noqa: E402

PY = sys.executable
TARGET_MS = 50.0  # p99 of every mode but the mixed node's
GPUS, PROCESSES = 8, 64
FLEET = 8  # vLLM servers, and as many ledger workers
MIXED = 64  # engines of the mixed node
MIXED_TARGET_MS, MIXED_RSS_MIB = 100.0, 150.0
WARM_UP = 20  # scrapes before the measured ones: imports, caches, the engines' first connections and versions
PEER = "peer: bare prometheus_client"

PEER_CODE = """
import logging, signal, sys
from prometheus_client import start_http_server
server, _ = start_http_server(0, addr="127.0.0.1")
print(f"listening on http://127.0.0.1:{server.server_address[1]}/metrics", file=sys.stderr, flush=True)
signal.sigwait([signal.SIGTERM, signal.SIGINT])
"""


def serve_fake_nvml(worker_pid: int, exporter_args: list[str]) -> int:
    """Runs the real exporter over a fake NVML of GPUS x PROCESSES (the worker is one of them)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from fake_pynvml import FakeGpu, FakePynvml, GiB, proc

    def pid(gpu: int, slot: int) -> int:
        return worker_pid if (gpu, slot) == (0, 0) else 100_000 + gpu * 1000 + slot

    gpus = [FakeGpu(f"GPU-{g:08x}-bench", allocated=60 * GiB, reserved=GiB // 2,
                    processes=[proc(pid(g, s), f"job{s}", 0.25 + s / 128) for s in range(PROCESSES)])
            for g in range(GPUS)]
    sys.modules["pynvml"] = FakePynvml(gpus)
    from vramledger.exporter.cli import main
    return main(["--backend", "nvml", *exporter_args])


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    with log.open("w") as stderr:
        proc = subprocess.Popen(args, cwd=ROOT, stderr=stderr)
    try:
        found = wait_until(lambda: re.search(r"listening on http://[\d.]+:(\d+)/metrics", log.read_text()), 60,
                           "the exporter to listen", proc, log, interval=0.05)
    except (ProcessExited, WaitTimedOut) as e:
        proc.kill()
        sys.exit(str(e))
    return proc, int(found.group(1))


def measure(port: int, pid: int, scrapes: int) -> tuple[list[float], float, str]:
    """Sorted scrape latencies (ms), the exporter's CPU per scrape (ms), the last scrape's text."""
    import httpx
    import psutil
    url = f"http://127.0.0.1:{port}/metrics"
    exporter = psutil.Process(pid)
    with httpx.Client(timeout=10, trust_env=False) as client:
        for _ in range(WARM_UP):
            client.get(url).raise_for_status()
        times = []
        cpu = exporter.cpu_times()
        for _ in range(scrapes):
            t0 = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - t0) * 1000)
            response.raise_for_status()
        spent = exporter.cpu_times()
    cpu_ms = 1000 * (spent.user + spent.system - cpu.user - cpu.system) / scrapes
    return sorted(times), cpu_ms, response.text


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory since it started (VmHWM), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else float("nan")


def percentile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, round(q * (len(sorted_ms) - 1)))]


def collect_mean_ms(text: str) -> float:
    total = re.search(r"^vramledger_exporter_collect_seconds_sum (\S+)", text, re.MULTILINE)
    count = re.search(r"^vramledger_exporter_collect_seconds_count (\S+)", text, re.MULTILINE)
    return 1000 * float(total.group(1)) / float(count.group(1)) if total and count else float("nan")


def spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-fake-nvml":
        raise SystemExit(serve_fake_nvml(int(sys.argv[2]), sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--modes", default="fleet,nvml,host")
    args = parser.parse_args()
    chosen = set(args.modes.split(","))

    procs: list[subprocess.Popen] = []
    results: dict[str, list[tuple[int, float, float, float, float, float]]] = {}
    engines_ms: dict[str, list[float]] = {}  # mode -> the engines' own CPU ms per scrape, per run
    try:
        with tempfile.TemporaryDirectory() as tmp:
            worker = ledger_worker(procs)
            worker_pid = procs[-1].pid
            modes: dict[str, list[str]] = {}
            goals: dict[str, tuple[float, float | None]] = {}  # mode -> (p99 ms, peak RSS MiB or None)
            fleets: dict[str, list] = {}  # mode -> the engines' processes, whose CPU per scrape is printed
            if "fleet" in chosen:
                fleet = ["--engine-timeout", "1"]
                for _ in range(FLEET):
                    fleet += ["--vllm", vllm_server(procs), "--worker", ledger_worker(procs)]
                modes[f"fleet: host, {FLEET} vLLM + {FLEET} workers"] = [
                    PY, "-m", "vramledger.exporter", "--backend", "host", "--port", "0", *fleet]
            common = ["--port", "0", "--worker", worker]
            if "nvml" in chosen:
                fake = [PY, "bench/exporter.py", "--serve-fake-nvml", str(worker_pid), *common]
                modes[f"nvml (fake) {GPUS}x{PROCESSES}, default --max-processes"] = fake
                modes[f"nvml (fake) {GPUS}x{PROCESSES}, --max-processes {PROCESSES}"] = [
                    *fake, "--max-processes", str(PROCESSES)]
            if "host" in chosen:
                modes["host: this machine, 1 worker"] = [PY, "-m", "vramledger.exporter", "--backend", "host", *common]
            if "mixed" in chosen:
                before = len(procs)
                mixed = start_mixed(MIXED, procs, Path(tmp))
                count, pss = footprint(procs[before:])
                print(f"mixed node: {MIXED} engines in {count} processes, {pss / 2**20:.0f} MiB PSS in all",
                      file=sys.stderr)
                name = f"mixed: host, {MIXED} engines of {len(set(mixed[::2]))} kinds"
                modes[name] = [PY, "-m", "vramledger.exporter", "--backend", "host", "--port", "0", *mixed]
                goals[name] = (MIXED_TARGET_MS, MIXED_RSS_MIB)
                fleets[name] = tree(procs[before:])
            modes[PEER] = [PY, "-c", PEER_CODE]
            for run in range(args.runs):
                for i, (name, cmd) in enumerate(modes.items()):
                    proc, port = start(cmd, Path(tmp) / f"{run}-{i}.log")
                    engines_cpu = cpu_seconds(fleets.get(name, []))
                    try:
                        times, cpu_ms, text = measure(port, proc.pid, args.scrapes)
                        engines_cpu = cpu_seconds(fleets.get(name, [])) - engines_cpu
                        rss_mib = peak_rss_mib(proc.pid)
                        if name in goals and serving(text) != MIXED:  # a scrape of engines down measures less
                            sys.exit(f"{name}: {serving(text)} of {MIXED} engines serving at the last scrape")
                    finally:
                        proc.terminate()
                        proc.wait(timeout=10)
                    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
                    results.setdefault(name, []).append((series, percentile(times, 0.5), percentile(times, 0.99),
                                                         collect_mean_ms(text), cpu_ms, rss_mib))
                    if name in fleets:
                        engines_ms.setdefault(name, []).append(1000 * engines_cpu / (WARM_UP + args.scrapes))
    finally:
        for proc in procs:  # a vLLM tree's children exit when its API server does (their stdin closes)
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    peer_p99 = statistics.median(r[2] for r in results[PEER])
    print(f"exporter scrape latency over HTTP: {args.runs} runs per mode (a fresh exporter each), "
          f"{args.scrapes} scrapes per run after {WARM_UP} warm-up; min / median / max over the runs")
    print(f"{'mode':<46}{'series':>7}{'p50 ms':>22}{'p99 ms':>22}{'collect ms (mean)':>22}"
          f"{'CPU ms/scrape':>22}{'peak RSS MiB':>22}{'p99/target':>12}{'RSS/goal':>10}{'p99/peer':>10}")
    for name, runs in results.items():
        p99 = statistics.median(r[2] for r in runs)
        target_ms, rss_goal = goals.get(name, (TARGET_MS, None))
        rss = "" if rss_goal is None else f"{max(r[5] for r in runs) / rss_goal:.2f}"
        columns = "".join(f"{spread([r[i] for r in runs]):>22}" for i in (1, 2, 3, 4, 5))
        print(f"{name:<46}{runs[0][0]:>7}{columns}{p99 / target_ms:>12.2f}{rss:>10}{p99 / peer_p99:>10.1f}")
    print(f"targets: p99 < {TARGET_MS:.0f} ms, mixed mode p99 < {MIXED_TARGET_MS:.0f} ms and peak RSS < "
          f"{MIXED_RSS_MIB:.0f} MiB (median p99/target < 1, RSS/goal of the largest peak < 1). CPU ms/scrape: "
          "the exporter process's CPU time over the measured scrapes, per scrape (the engines' own CPU not "
          "included)")
    for name, per_run in engines_ms.items():
        print(f"{name}: the engines' own CPU per scrape (on the same cores as the exporter), ms: {spread(per_run)}")


if __name__ == "__main__":
    main()
