"""The exporter as a real process, in host mode, beside real worker and foreign processes."""
from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from kube_api import Clock
from prometheus_client.parser import text_string_to_metric_families

from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.procfs import ProportionalSizes, read_pss, read_rss, read_start
from vramledger.exporter.sources import HostSource
from vramledger.worker.selfcheck.processes import wait_until

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MiB = 1 << 20
HOLD = ("import sys; b = bytearray(b'\\x01') * (int(sys.argv[1]) << 20); print('ready', flush=True); "
        "sys.stdin.read()")


@pytest.fixture
def spawn():
    """Starts real processes; every one is killed when the test ends."""
    procs: list[subprocess.Popen] = []

    def start(args, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(args, cwd=ROOT, **kwargs)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe:
                pipe.close()


def read_line(proc: subprocess.Popen, timeout: float = 20) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output from {proc.args} within {timeout}s"
    return proc.stdout.readline().strip()


def start_worker(spawn, *prefix: str, model_mib: int = 64, container_id: str | None = None):
    args = [*prefix, PY, "tests/ledger_worker.py", "--model-mib", str(model_mib)]
    if container_id:
        args += ["--container-id", container_id]
    proc = spawn(args, stdout=subprocess.PIPE, text=True)
    line = read_line(proc)
    assert line.startswith("port "), line
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def start_exporter(spawn, log: Path, *args: str):
    with log.open("w") as stderr:
        proc = spawn([PY, "-m", "vramledger.exporter", "--port", "0", *args], stderr=stderr)
    found = wait_until(lambda: re.search(r"listening on http://[\d.]+:(\d+)/metrics", log.read_text()), 20,
                       "the exporter to listen", proc, log, interval=0.05)
    return proc, int(found.group(1))


def scrape(port: int) -> list:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    response.raise_for_status()
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def find(samples, name: str, **labels) -> list:
    return [s for s in samples if s.name == name and labels.items() <= s.labels.items()]


def one(samples, name: str, **labels) -> float:
    found = find(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0].value


def test_worker_and_foreign_processes(spawn, tmp_path):
    worker, url = start_worker(spawn)
    foreign = spawn([PY, "-c", HOLD, "512"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert read_line(foreign) == "ready"
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", url)

    samples = scrape(port)
    [mine] = find(samples, "vramledger_device_process_memory_bytes", pid=str(worker.pid))
    assert mine.labels == {"device": "host", "uuid": "", "pid": str(worker.pid),
                           "process": psutil.Process(worker.pid).name(), "owner": "engine", "engine": url,
                           "measure": "pss"}
    assert mine.value >= 64 * MiB
    assert one(samples, "vramledger_engine_observed_memory_bytes", engine=url, device="host") == mine.value
    [theirs] = find(samples, "vramledger_device_process_memory_bytes", pid=str(foreign.pid))
    assert theirs.labels == {"device": "host", "uuid": "", "pid": str(foreign.pid),
                             "process": psutil.Process(foreign.pid).name(), "owner": "foreign", "engine": "",
                             "measure": "pss"}
    assert theirs.value >= 512 * MiB
    assert one(samples, "vramledger_device_foreign_memory_bytes", device="host") >= theirs.value
    assert one(samples, "vramledger_engine_up", engine=url) == 1
    assert one(samples, "vramledger_exporter_collect_seconds_count") == 1
    assert one(samples, "vramledger_exporter_errors_total", source="host") == 0

    foreign.kill()
    foreign.wait(timeout=10)
    samples = scrape(port)
    assert find(samples, "vramledger_device_process_memory_bytes", pid=str(foreign.pid)) == []
    assert len(find(samples, "vramledger_device_process_memory_bytes", pid=str(worker.pid))) == 1


def test_memory_held_outside_the_ledger_is_unaccounted(spawn, tmp_path):
    _, url = start_worker(spawn)
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", url)
    before = scrape(port)
    httpx.post(f"{url}/test/hold?mib=256", timeout=10).raise_for_status()
    after = scrape(port)

    def unaccounted(samples):
        return one(samples, "vramledger_engine_unaccounted_memory_bytes", engine=url, device="host")

    assert 0.9 * 256 * MiB <= unaccounted(after) - unaccounted(before) <= 1.1 * 256 * MiB
    assert (one(after, "vramledger_engine_declared_memory_bytes", engine=url)
            == one(before, "vramledger_engine_declared_memory_bytes", engine=url))


def test_killed_worker_is_down_and_the_exporter_keeps_serving(spawn, tmp_path):
    worker, url = start_worker(spawn)
    exporter, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", url,
                                    "--engine-timeout", "0.5")
    assert one(scrape(port), "vramledger_engine_up", engine=url) == 1
    worker.kill()
    worker.wait(timeout=10)
    for _ in range(2):
        samples = scrape(port)
        assert one(samples, "vramledger_engine_up", engine=url) == 0
        assert find(samples, "vramledger_engine_declared_memory_bytes") == []
        assert find(samples, "vramledger_device_process_memory_bytes", pid=str(worker.pid)) == []
        assert one(samples, "vramledger_device_memory_total_bytes", device="host") > 0
    # Down is what worker_up says; it is not also an exporter error (one fault, one alert).
    assert one(samples, "vramledger_exporter_errors_total", source="worker") == 0
    assert exporter.poll() is None


def own_container_id() -> str | None:
    """The longest path component of this process's cgroups: what a container id looks like here."""
    parts = re.split(r"[/:\n.]", Path("/proc/self/cgroup").read_text())
    return max((p for p in parts if len(p) >= 12), key=len, default=None)


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not can_unshare() or own_container_id() is None,
                    reason="needs a new pid namespace (root, unshare) and a container id in its cgroup")
def test_worker_in_its_own_pid_namespace_is_matched_through_nspid(spawn, tmp_path):
    # A real pid namespace: the worker believes it is pid 1; only NSpid and its cgroup give it away.
    wrapper, url = start_worker(spawn, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                                container_id=own_container_id())
    [worker] = psutil.Process(wrapper.pid).children()
    assert httpx.get(f"{url}/v1/memory", timeout=10).json()["worker"]["pid"] == 1
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", url)
    samples = scrape(port)
    [mine] = find(samples, "vramledger_device_process_memory_bytes", owner="engine")
    assert (mine.labels["pid"], mine.labels["engine"]) == (str(worker.pid), url)
    assert one(samples, "vramledger_engine_observed_memory_bytes", engine=url, device="host") == mine.value


def nvml_works() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - any failure means no NVML here
        return False


@pytest.mark.skipif(nvml_works(), reason="this machine has a working NVML")
def test_backend_nvml_without_nvml_exits_with_a_message():
    done = subprocess.run([PY, "-m", "vramledger.exporter", "--backend", "nvml", "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "NVML unavailable" in done.stderr and "--backend auto" in done.stderr


@pytest.mark.skipif(nvml_works(), reason="this machine has a working NVML")
def test_backend_auto_without_nvml_falls_back_to_the_host(spawn, tmp_path):
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "auto")
    assert "falling back to the host reader" in (tmp_path / "exporter.log").read_text()
    assert one(scrape(port), "vramledger_device_memory_total_bytes", device="host", uuid="") > 0


# --- memory that adds up: PSS -----------------------------------------------------------------

SHARE = ("import os, sys; b = bytearray(b'\\x01') * (256 << 20); child = os.fork()\n"
         "if child == 0: sys.stdin.read(); os._exit(0)\n"
         "print(child, flush=True); sys.stdin.read(); os.waitpid(child, 0)")


def test_pages_two_processes_share_are_listed_once(spawn):
    # 256 MiB written, then forked: parent and child map the same pages until one writes them.
    parent = spawn([PY, "-c", SHARE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = int(read_line(parent))
    pair = {parent.pid, child}
    assert sum(psutil.Process(pid).memory_info().rss for pid in pair) >= 2 * 256 * MiB  # RSS: twice
    [host] = HostSource(ErrorLog(), min_process_bytes=64 * MiB).read()
    listed = {p.pid: p for p in host.processes}
    assert {listed[pid].measure for pid in pair} == {"pss"}
    assert 256 * MiB <= sum(listed[pid].bytes for pid in pair) <= 256 * MiB + 64 * MiB  # once, + 2 runtimes
    # Every listed process counted by PSS: together they fit in what the host uses, and the rest of
    # "used" (kernel, small processes) shows as unattributed.
    assert {p.measure for p in host.processes} == {"pss"}
    assert sum(p.bytes for p in host.processes) < host.used


def test_pss_is_reread_only_when_old_and_follows_rss_between(spawn):
    hold = spawn([PY, "-c", HOLD, "64"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert read_line(hold) == "ready"
    proc, clock = psutil.Process(hold.pid), Clock()
    created, rss = read_start(hold.pid), read_rss(hold.pid)
    # Read from /proc directly, as psutil reads them.
    assert rss == proc.memory_info().rss
    assert abs(psutil.boot_time() + created / os.sysconf("SC_CLK_TCK") - proc.create_time()) < 0.05
    sizes = ProportionalSizes(max_age=30, clock=clock)
    first = sizes.sizes({hold.pid: (created, rss)})[hold.pid]
    assert first == read_pss(hold.pid) and 64 * MiB <= first <= rss
    # Within max_age: not read again, the RSS change carried over (as if 8 MiB more were mapped).
    assert sizes.sizes({hold.pid: (created, rss + 8 * MiB)}) == {hold.pid: first + 8 * MiB}
    assert sizes.sizes({hold.pid: (created, 1)}) == {hold.pid: 0}  # shrunk past what it shared: never below 0
    clock.now += 30
    assert sizes.sizes({hold.pid: (created, rss)}) == {hold.pid: read_pss(hold.pid)}  # read again
    # Another process under the same pid (a reused pid) is read at once.
    assert sizes.sizes({hold.pid: (created + 1, rss + 8 * MiB)}) == {hold.pid: read_pss(hold.pid)}


def test_rss_where_pss_cannot_be_read(tmp_path, spawn):
    hold = spawn([PY, "-c", HOLD, "64"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert read_line(hold) == "ready"
    assert read_pss(hold.pid, tmp_path) is None  # no smaps_rollup there (an old kernel, or no access)
    [host] = HostSource(ErrorLog(), 64 * MiB, ProportionalSizes(proc_root=tmp_path)).read()
    [mine] = [p for p in host.processes if p.pid == hold.pid]
    assert mine.measure == "rss" and mine.bytes >= 64 * MiB
