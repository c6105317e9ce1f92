"""The exporter exits 0 promptly on SIGTERM, even while a scrape waits on workers that never answer."""
from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_exporter_host import scrape, spawn, start_exporter  # noqa: F401

PROMPT = 10.0  # seconds; a stuck scrape would hold the exporter for its 600 s --engine-timeout


def silent_listener() -> tuple[socket.socket, str]:
    """A worker address that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def test_idle_exporter_exits_0_on_sigterm(spawn, tmp_path):  # noqa: F811
    proc, port = start_exporter(spawn, tmp_path / "exporter.log", "--backend", "host")
    assert scrape(port)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=PROMPT) == 0


def test_exporter_exits_promptly_during_a_stuck_scrape(spawn, tmp_path):  # noqa: F811
    listeners = [silent_listener() for _ in range(2)]
    args = ["--backend", "host", "--engine-timeout", "600"]
    for _, url in listeners:
        args += ["--worker", url]
    proc, port = start_exporter(spawn, tmp_path / "exporter.log", *args)
    scraping = threading.Thread(target=lambda: _scrape_ignoring_errors(port), daemon=True)
    scraping.start()
    # Both workers have an open, unanswered request: the scrape is stuck on them.
    waiting, deadline = [s for s, _ in listeners], time.monotonic() + 10
    while waiting and time.monotonic() < deadline:
        waiting = [s for s in waiting if not _accept(s)]
        time.sleep(0.05)
    assert waiting == []
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=PROMPT) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the exporter waits for a stuck scrape instead of exiting on SIGTERM; its threads' "
                    f"signal state:\n{_signal_state(proc.pid)}")
    for server, _ in listeners:
        server.close()


def _accept(server: socket.socket) -> bool:
    """Accept the exporter's connection if it came (and never answer it)."""
    server.setblocking(False)
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    _held.append(conn)  # keep it open, unanswered
    return True


_held: list[socket.socket] = []


def _signal_state(pid: int) -> str:
    """Each thread's state and signal masks from /proc: whether SIGTERM is pending, blocked or caught."""
    fields = ("Name", "State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    lines = []
    for status in sorted(Path(f"/proc/{pid}/task").glob("*/status")):
        pairs = (line.split(":\t", 1) for line in status.read_text().splitlines())
        lines.append(" ".join(f"{k}={v.strip()}" for k, v in pairs if k in fields))
    return "\n".join(lines)


def _scrape_ignoring_errors(port: int) -> None:
    try:
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60)
    except httpx.HTTPError:
        pass
