"""The engines bench/exporter.py's exporter watches: each a real process (with its children, as the real
engine has them) listening on its own port, answering in that engine's real shapes.

- our worker: tests/ledger_worker.py, a process that holds memory and serves its ledger;
- vLLM: tests/vllm_tree.py, an API server -> engine core -> rank tree serving /metrics recorded from
  vLLM's CPU build;
- the kinds that need a GPU (SGLang, Ollama, llama.cpp, TGI, TensorRT-LLM behind Triton):
  tests/fake_engines.py, one server process per engine with one child (SGLang's scheduler, Ollama's
  runner), answering tests/engine_shapes.py's routes. One process per engine, never one serving
  several ports: the exporter finds an engine's processes by its listening port.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
RECORDED = ROOT / "tests" / "data" / "vllm_spec_metrics.txt"
WORKER_MIB = 64  # what each ledger worker holds as its "weights"


def start_backend(args: list[str], procs: list[subprocess.Popen]) -> str:
    """A ledger worker or vLLM tree: started, its base URL once it prints "port N"."""
    proc = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "port":
        sys.exit(f"{args} did not start: {line}")
    return f"http://127.0.0.1:{line[1]}"


def ledger_worker(procs: list[subprocess.Popen]) -> str:
    return start_backend([PY, "tests/ledger_worker.py", "--model-mib", str(WORKER_MIB)], procs)


def vllm_server(procs: list[subprocess.Popen]) -> str:
    return start_backend([PY, "tests/vllm_tree.py", str(RECORDED)], procs)


def mixed_kinds(n: int) -> list:
    """n engine kinds, every registered kind in turn (sorted by name), so each is within one of n / kinds."""
    from vramledger.exporter.engines.registry import kinds
    ordered = sorted(kinds(), key=lambda kind: kind.name)
    return [ordered[i % len(ordered)] for i in range(n)]


def start_mixed(n: int, procs: list[subprocess.Popen], tmp: Path) -> list[str]:
    """Starts n engines of mixed kinds; the exporter's arguments that watch them, each under its kind's flag."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_engines import FakeEngine, kind_routes

    from vramledger.exporter.engines import vllm, vramledger
    routes = {kind.name: answers for kind, answers in kind_routes()}

    def spawn(args: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, cwd=ROOT, **kwargs)
        procs.append(proc)
        return proc

    watched: list[str] = []
    for kind in mixed_kinds(n):
        if kind.name == vramledger.NAME:
            url = ledger_worker(procs)
        elif kind.name == vllm.NAME:
            url = vllm_server(procs)
        elif kind.name in routes:
            url = FakeEngine(spawn, tmp, routes[kind.name], children=1).url
        else:
            sys.exit(f"no server to start for {kind.title}: give its answers in tests/fake_engines.py kind_routes")
        watched += [kind.flag, url]
    return watched


def serving(text: str) -> int:
    """How many engines an exposition says are serving (vramledger_engine_up 1)."""
    return len(re.findall(r"^vramledger_engine_up\{[^}]*\} 1(?:\.0)?$", text, re.MULTILINE))


def tree(procs: list[subprocess.Popen]) -> list[psutil.Process]:
    """procs and their descendants, as they are now."""
    found = []
    for proc in procs:
        try:
            top = psutil.Process(proc.pid)
            found += [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found


def footprint(procs: list[subprocess.Popen]) -> tuple[int, int]:
    """(processes, bytes of PSS) of procs and their descendants: what the engines cost this machine."""
    processes = tree(procs)
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except psutil.NoSuchProcess:
            continue
    return len(processes), total


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """The CPU time the processes have spent so far (user + system)."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total
