"""An engine's lifecycle under a running exporter: a restart is states and log lines, never errors."""
from __future__ import annotations

import re
import signal
import subprocess
import time

from test_exporter_host import PY, find, one, read_line, scrape, spawn, start_exporter  # noqa: F401

STATES = ("serving", "loading", "unreachable", "wrong")


def state_of(samples, url: str) -> str:
    [now] = [s.labels["state"] for s in find(samples, "vramledger_engine_state", engine=url) if s.value == 1]
    assert sorted(s.labels["state"] for s in find(samples, "vramledger_engine_state", engine=url)) == sorted(
        STATES)
    return now


def watch_states(port: int, url: str, until: str, seen: list[str], timeout: float = 60) -> list:
    """Scrapes every 0.1 s, noting each new state, until the state is `until`; the last samples."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = scrape(port)
        now = state_of(samples, url)
        if not seen or seen[-1] != now:
            seen.append(now)
        assert one(samples, "vramledger_exporter_errors_total", source="worker") == 0, seen
        if now == until:
            return samples
        time.sleep(0.1)
    raise AssertionError(f"{url} not {until} after {timeout}s: {seen}")


def ledger_worker(spawn, *args: str):  # noqa: F811
    proc = spawn([PY, "tests/ledger_worker.py", *args], stdout=subprocess.PIPE, text=True)
    line = read_line(proc)
    assert line.startswith("port "), line
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def test_a_worker_restarted_under_a_running_exporter(spawn, tmp_path):  # noqa: F811
    worker, url = ledger_worker(spawn)
    log = tmp_path / "exporter.log"
    _, port = start_exporter(spawn, log, "--backend", "host", "--worker", url, "--engine-timeout", "0.5")
    seen: list[str] = []
    samples = watch_states(port, url, "serving", seen)
    assert one(samples, "vramledger_engine_up", engine=url) == 1

    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=10)
    samples = watch_states(port, url, "unreachable", seen)
    assert one(samples, "vramledger_engine_up", engine=url) == 0
    for _ in range(3):  # still down: no new line, no error
        watch_states(port, url, "unreachable", seen)

    # The same worker again on its port, loading for 2 s first as the real one does.
    ledger_worker(spawn, "--port", url.rsplit(":", 1)[1], "--loading-seconds", "2")
    watch_states(port, url, "serving", seen)
    assert seen == ["serving", "unreachable", "loading", "serving"]

    lines = [line.split(" vramledger.exporter.engines: ", 1)[1] for line in log.read_text().splitlines()
             if " vramledger.exporter.engines: " in line]
    assert len(lines) == 4, lines
    assert re.fullmatch(rf"vramledger {url}: serving \(\d+\.\d s after watching began\)", lines[0])
    assert lines[1].startswith(f"vramledger {url}: unreachable: {url}/v1/memory: ConnectionRefusedError")
    assert lines[2] == f"vramledger {url}: loading: {url}/v1/memory: 503 model_loading"
    away = float(re.fullmatch(rf"vramledger {url}: serving again after (\d+\.\d) s away", lines[3]).group(1))
    assert away >= 2  # at least its loading
    assert "HTTP Request" not in log.read_text()  # httpx's line per request is off
