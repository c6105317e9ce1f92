"""scripts/local_stack.py as `make run` starts it: any signal stops every service it started, and a
service never outlives it (even when the launcher is killed with SIGKILL)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys

import psutil
import pytest
from test_exporter_host import ROOT

from vramledger.worker.selfcheck.processes import free_port, wait_http, wait_until

pytestmark = pytest.mark.slow  # it starts processes (`make test-fast` leaves it out)

SCRIPT = ROOT / "scripts" / "local_stack.py"


def launch(checkpoints, workdir) -> tuple[subprocess.Popen, dict[str, int]]:
    ports = {"worker": free_port(), "exporter": free_port(), "prometheus": free_port()}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--workdir", str(workdir),
                             *(f"--{name}-port={port}" for name, port in ports.items()),
                             "--", "--model", checkpoints["llama"], "--no-draft", "--max-model-len", "128"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(workdir.parent / "launcher.log").open("w"))
    return proc, ports


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def listening(port: int) -> bool:
    """Whether anything still listens on the port (a server could not bind it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def wait_gone(pids: list[int], timeout: float) -> None:
    wait_until(lambda: not any(alive(p) for p in pids), timeout, f"every one of {pids} to exit", interval=0.1)


@pytest.fixture
def cleanup():
    pids: list[int] = []
    yield pids
    for pid in pids:  # only when the test failed: never leave a stray service behind
        if alive(pid):
            psutil.Process(pid).kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_to_the_running_stack_stops_every_service(checkpoints, tmp_path, cleanup, sig):
    proc, ports = launch(checkpoints, tmp_path / "run")
    cleanup.append(proc.pid)
    for name, path in (("worker", "/health"), ("exporter", "/metrics"), ("prometheus", "/-/ready")):
        wait_http(f"http://127.0.0.1:{ports[name]}{path}", 240, proc)
    services = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    cleanup.extend(services)
    assert len(services) == 3, psutil.Process(proc.pid).children(recursive=True)

    proc.send_signal(sig)
    code = proc.wait(timeout=120)
    assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    # After SIGKILL the launcher cleaned nothing: the kernel's parent-death signal stops each service.
    wait_gone(services, 60)
    assert [name for name, port in ports.items() if listening(port)] == []


def test_signal_while_the_worker_loads_stops_it(checkpoints, tmp_path, cleanup):
    proc, ports = launch(checkpoints, tmp_path / "run")
    cleanup.append(proc.pid)
    wait_until(lambda: psutil.Process(proc.pid).children(), 60, "the launcher to start the worker", proc,
               interval=0.05)
    services = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    cleanup.extend(services)
    proc.send_signal(signal.SIGHUP)  # a closed terminal, not Ctrl-C
    assert proc.wait(timeout=120) == 128 + signal.SIGHUP
    wait_gone(services, 10)
    assert not listening(ports["worker"])
