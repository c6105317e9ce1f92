"""The exporter in host mode beside our real worker (`python -m vramledger.worker serve` plus a test route)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from test_exporter_host import HOLD, PY, MiB, find, one, read_line, scrape, spawn, start_exporter  # noqa: F401
from test_exporter_lifecycle import watch_states

from vramledger.exporter.procfs import read_pss
from vramledger.worker.selfcheck.processes import free_port, wait_http

HERE = Path(__file__).parent


def start_real_worker(start, checkpoints) -> tuple[subprocess.Popen, str]:
    """Our worker on the small random target, with the test route, started by `start` (spawn, or
    Popen's signature) and not yet waited for; its process and URL."""
    port = free_port()
    proc = start([PY, str(HERE / "serve_with_hold_route.py"), "--model", checkpoints["llama"], "--no-draft",
                  "--max-model-len", "128", "--port", str(port)],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def worker(spawn, checkpoints):  # noqa: F811
    proc, url = start_real_worker(spawn, checkpoints)
    wait_http(url + "/health", 180, proc)
    return proc, url


def test_real_worker_beside_a_foreign_process(spawn, worker, tmp_path):  # noqa: F811
    proc, url = worker
    foreign = spawn([PY, "-c", HOLD, "512"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert read_line(foreign) == "ready"
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", url)
    samples = scrape(port)
    [mine] = find(samples, "vramledger_device_process_memory_bytes", pid=str(proc.pid))
    assert mine.labels["owner"] == "engine" and mine.labels["engine"] == url
    declared = httpx.get(url + "/v1/memory").json()["declared_bytes"]
    assert one(samples, "vramledger_engine_declared_memory_bytes", engine=url) == declared
    [theirs] = find(samples, "vramledger_device_process_memory_bytes", pid=str(foreign.pid))
    assert theirs.labels["owner"] == "foreign" and theirs.value >= 512 * MiB
    foreign.kill()
    foreign.wait(timeout=10)
    assert find(scrape(port), "vramledger_device_process_memory_bytes", pid=str(foreign.pid)) == []


def test_memory_the_real_worker_holds_outside_its_ledger_is_unaccounted(spawn, worker, tmp_path):  # noqa: F811
    proc, url = worker
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", url)
    before = scrape(port)
    httpx.post(url + "/test/hold", params={"mib": 256}, timeout=30).raise_for_status()
    after = scrape(port)

    def value(samples, name: str) -> float:
        return one(samples, f"vramledger_engine_{name}_memory_bytes", engine=url, device="host")

    declared = one(after, "vramledger_engine_declared_memory_bytes", engine=url)
    observed = value(after, "observed")
    assert observed == pytest.approx(read_pss(proc.pid), rel=0.02)  # PSS: its pages, shared ones split
    assert 0.9 * 256 * MiB <= observed - value(before, "observed") <= 1.1 * 256 * MiB
    # The ledger on the CPU declares RSS; the exporter observes PSS, lower by the worker's part of
    # the pages it shares (libraries): that much of what it holds undeclared does not show.
    gap = max(0, declared - value(before, "observed"))
    assert value(after, "unaccounted") == max(0, observed - declared)
    assert value(after, "unaccounted") - value(before, "unaccounted") == pytest.approx(256 * MiB - gap,
                                                                                     abs=0.1 * 256 * MiB)


def test_killing_the_real_worker_marks_it_down(spawn, worker, tmp_path):  # noqa: F811
    proc, url = worker
    _, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host", "--worker", url,
                             "--engine-timeout", "0.5")
    assert one(scrape(port), "vramledger_engine_up", engine=url) == 1
    proc.kill()
    proc.wait(timeout=10)
    samples = scrape(port)
    assert one(samples, "vramledger_engine_up", engine=url) == 0
    assert find(samples, "vramledger_engine_declared_memory_bytes") == []


def test_a_real_worker_starting_under_the_exporter_is_loading_then_serving(spawn, checkpoints,  # noqa: F811
                                                                           tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "exporter.log"
    _, exporter_port = start_exporter(spawn, log, "--backend", "host", "--worker", url, "--engine-timeout",
                                      "0.5")
    seen: list[str] = []
    watch_states(exporter_port, url, "unreachable", seen)
    proc = spawn([PY, "-m", "vramledger.worker", "serve", "--model", checkpoints["llama"], "--no-draft",
                  "--max-model-len", "128", "--port", str(port)],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watch_states(exporter_port, url, "serving", seen, timeout=180)
    # Starting: nothing listens while it imports, then 503 model_loading while it loads.
    assert seen == ["unreachable", "loading", "serving"]
    proc.terminate()  # it drains (nothing in flight) and exits
    proc.wait(timeout=60)
    watch_states(exporter_port, url, "unreachable", seen)
    lines = [line.split(" vramledger.exporter.engines: ", 1)[1] for line in log.read_text().splitlines()
             if " vramledger.exporter.engines: " in line]
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["unreachable", "loading", "serving",
                                                                      "unreachable"], lines
    assert lines[1].endswith("/v1/memory: 503 model_loading")
