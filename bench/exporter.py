"""Exporter scrape latency (p50/p99) over real sockets: fake NVML with 8 GPUs x 64 processes, and
the host reader on this machine, beside a bare prometheus_client server as the peer. The fake
runs twice: with the default --max-processes (32 series + pid="other" per GPU) and with every
process shown.

    python bench/exporter.py [--scrapes 500]

Each exporter is a separate process watching one real ledger worker (tests/ledger_worker.py);
this process only scrapes, one request at a time. Target: p99 under 50 ms.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TARGET_MS = 50.0
GPUS, PROCESSES = 8, 64

PEER = """
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
    from exporter.cli import main
    return main(["--backend", "nvml", *exporter_args])


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    with log.open("w") as stderr:
        proc = subprocess.Popen(args, cwd=ROOT, stderr=stderr)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"listening on http://[\d.]+:(\d+)/metrics", log.read_text())
        if found:
            return proc, int(found.group(1))
        if proc.poll() is not None:
            sys.exit(f"{args} exited:\n{log.read_text()}")
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"{args} not listening after 30s:\n{log.read_text()}")


def measure(port: int, scrapes: int) -> tuple[list[float], str]:
    import httpx
    url = f"http://127.0.0.1:{port}/metrics"
    with httpx.Client(timeout=10, trust_env=False) as client:
        for _ in range(20):  # warm-up: imports, caches, the worker's first connection
            client.get(url).raise_for_status()
        times = []
        for _ in range(scrapes):
            t0 = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - t0) * 1000)
            response.raise_for_status()
    return sorted(times), response.text


def percentile(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, round(q * (len(sorted_ms) - 1)))]


def collect_mean_ms(text: str) -> str:
    total = re.search(r"^vramledger_exporter_collect_seconds_sum (\S+)", text, re.MULTILINE)
    count = re.search(r"^vramledger_exporter_collect_seconds_count (\S+)", text, re.MULTILINE)
    return f"{1000 * float(total.group(1)) / float(count.group(1)):.2f}" if total and count else "-"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-fake-nvml":
        raise SystemExit(serve_fake_nvml(int(sys.argv[2]), sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=500)
    scrapes = parser.parse_args().scrapes

    procs: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            worker = subprocess.Popen([PY, "tests/ledger_worker.py", "--model-mib", "64"], cwd=ROOT,
                                      stdout=subprocess.PIPE, text=True)
            procs.append(worker)
            url = f"http://127.0.0.1:{worker.stdout.readline().split()[1]}"
            common = ["--port", "0", "--worker", url]
            fake = [PY, "bench/exporter.py", "--serve-fake-nvml", str(worker.pid), *common]
            modes = {
                f"nvml (fake) {GPUS}x{PROCESSES}, default --max-processes": fake,
                f"nvml (fake) {GPUS}x{PROCESSES}, --max-processes {PROCESSES}":
                    [*fake, "--max-processes", str(PROCESSES)],
                "host (psutil), this machine": [PY, "-m", "exporter", "--backend", "host", *common],
                "peer: bare prometheus_client": [PY, "-c", PEER],
            }
            results = {}
            for i, (name, args) in enumerate(modes.items()):
                proc, port = start(args, Path(tmp) / f"{i}.log")
                procs.append(proc)
                times, text = measure(port, scrapes)
                series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
                results[name] = (series, percentile(times, 0.5), percentile(times, 0.99),
                                 collect_mean_ms(text))
                proc.terminate()
                proc.wait(timeout=10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)

    peer_p99 = results["peer: bare prometheus_client"][2]
    print(f"exporter scrape latency over HTTP, {scrapes} scrapes per mode after 20 warm-up, 1 ledger worker")
    print(f"{'mode':<42}{'series':>7}{'p50 ms':>9}{'p99 ms':>9}{'collect ms':>12}"
          f"{'p99/target':>12}{'p99/peer':>10}")
    for name, (series, p50, p99, collect) in results.items():
        print(f"{name:<42}{series:>7}{p50:>9.2f}{p99:>9.2f}{collect:>12}{p99 / TARGET_MS:>12.2f}"
              f"{p99 / peer_p99:>10.1f}")
    print(f"target: p99 < {TARGET_MS:.0f} ms (p99/target < 1)")


if __name__ == "__main__":
    main()
