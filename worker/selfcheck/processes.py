"""Every process selfcheck starts, each in its own process group, always stopped on the way out."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Started:
    """One started process, its log, and what it was started as."""

    name: str
    popen: subprocess.Popen
    log_path: Path | None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]


class Processes:
    """Starts processes in new sessions (their own process groups) and stops every group at close().

    A child also gets SIGTERM if selfcheck dies without running close() (PR_SET_PDEATHSIG, Linux).
    """

    def __init__(self, workdir: Path, env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.env = dict(os.environ if env is None else env)
        self.started: list[Started] = []

    def start(self, name: str, cmd: list[str], stdin=subprocess.DEVNULL, stdout=None,
              env: dict[str, str] | None = None, drop_env: tuple[str, ...] = ()) -> Started:
        """Start cmd; its output goes to <workdir>/<name>.log unless stdout is given."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = None
        if stdout is None:
            log_path = self.workdir / f"{name}.log"
            out = open(log_path, "wb")
        else:
            out = stdout
        try:
            popen = subprocess.Popen(cmd, stdin=stdin, stdout=out,
                                     stderr=subprocess.STDOUT if stdout is None else None,
                                     env={k: v for k, v in {**self.env, **(env or {})}.items()
                                          if k not in drop_env},
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent)
        finally:
            if stdout is None:
                out.close()  # the child holds its own descriptor
        started = Started(name, popen, log_path)
        self.started.append(started)
        log.debug("started %s (pid %d): %s", name, popen.pid, " ".join(cmd))
        return started

    def stop(self, proc: Started, timeout: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it when it is still there after timeout."""
        if proc.alive():
            _signal_group(proc.popen, signal.SIGTERM)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s: killing it",
                            proc.name, proc.pid, timeout)
        # Whatever the leader did, nothing of its group may outlive it.
        _signal_group(proc.popen, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(5)
        _wait_group_gone(proc.popen.pid, 5.0)
        for pipe in (proc.popen.stdin, proc.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def close(self) -> None:
        # TERM them all first, so that they shut down in parallel; then wait and KILL each.
        for proc in self.started:
            if proc.alive():
                _signal_group(proc.popen, signal.SIGTERM)
        for proc in reversed(self.started):
            self.stop(proc)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)  # start_new_session: the group id is the leader's pid


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Until no process of the group is left (killed members are reaped by init, not by us)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)
    log.warning("process group %d still has members %.0f s after SIGKILL", pgid, timeout)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit in the main thread, so every finally block runs."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def wait_http(url: str, timeout: float, proc: Started | None = None) -> float:
    """Wait until url answers 200; return the seconds it took. Raises when proc exits first."""
    start = time.monotonic()
    with httpx.Client(timeout=2, trust_env=False) as client:
        while True:
            if proc is not None and not proc.alive():
                raise ProcessExited(proc)
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
            time.sleep(0.2)


class ProcessExited(RuntimeError):
    """A started process exited while it was expected to run; the message ends with its log."""

    def __init__(self, proc: Started):
        self.proc = proc
        super().__init__(f"{proc.name} (pid {proc.pid}) exited with code {proc.popen.returncode}")

    def last_error(self) -> str:
        """The most telling line of its log: the last 'error' line, else the last line."""
        lines = [line.strip() for line in self.proc.log_tail(8000).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        return (errors or lines or ["(no output)"])[-1]
