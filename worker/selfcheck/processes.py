"""Every process selfcheck starts, each in its own process group, always stopped on the way out; and the
one free_port / wait_until / wait_http that everything starting a local server uses (selfcheck, and
also scripts/local_stack.py, bench/ and tests/).

Those helpers live here, not in vramledger/, because selfcheck is the shipped command that needs them
and this module needs only the standard library and httpx (no torch: `scripts/local_stack.py` imports
it), while vramledger/ is copied whole into the vLLM plugin's wheel, which holds only what vLLM's
processes import.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick, released at once)."""
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
        stop_group(proc.popen, timeout, proc.name)
        for pipe in (proc.popen.stdin, proc.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def close(self, timeout: float = 15.0) -> None:
        # TERM them all first, so that they shut down in parallel, then give them one timeout between them:
        # one each, workers still loading (they exit once loaded) took a timeout apiece, one after another.
        for proc in self.started:
            if proc.alive():
                _signal_group(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in reversed(self.started):
            self.stop(proc, max(1.0, deadline - time.monotonic()))

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stop_group(popen: subprocess.Popen, timeout: float = 15.0, name: str = "process") -> None:
    """SIGTERM the group a process leads (started with start_new_session), SIGKILL what is left of it
    after timeout; returns once the group is gone."""
    if popen.poll() is None:
        _signal_group(popen, signal.SIGTERM)
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM for %.0f s: killing it", name, popen.pid, timeout)
    # Whatever the leader did, nothing of its group may outlive it.
    _signal_group(popen, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(5)
    _wait_group_gone(popen.pid, 5.0)


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


def wait_until(predicate: Callable[[], T], timeout: float, what: str,
               proc: Started | subprocess.Popen | None = None, log: Path | None = None,
               interval: float = 0.2) -> T:
    """Poll predicate() until it returns something true, and return that.

    proc: the process it waits on; ProcessExited as soon as it has exited (its output: `log`, or a
    Started's own log). WaitTimedOut after `timeout` seconds, naming `what` was awaited.
    """
    watched = proc if proc is None or isinstance(proc, Started) else Started(_name(proc), proc, log)
    deadline = time.monotonic() + timeout
    while True:
        if watched is not None and not watched.alive():
            raise ProcessExited(watched, what)
        if result := predicate():
            return result
        if time.monotonic() > deadline:
            raise WaitTimedOut(f"timed out after {timeout:g} s waiting for {what}", watched)
        time.sleep(interval)


def wait_http(url: str, timeout: float, proc: Started | subprocess.Popen | None = None, log: Path | None = None,
              ok: Collection[int] = (200,), check: Callable[[], None] | None = None,
              seen: list[int] | None = None) -> float:
    """Wait until url answers one of `ok`; return the seconds it took.

    proc and log as for wait_until. check runs before each try and may raise to give up (a stop
    signal); seen, when given, gets every status url answered (a loading server's 503s).
    """
    start = time.monotonic()
    with httpx.Client(timeout=2, trust_env=False) as client:  # loopback: no proxy
        def answered() -> bool:
            if check is not None:
                check()
            try:
                status = client.get(url).status_code
            except httpx.HTTPError:
                return False  # not listening yet
            if seen is not None:
                seen.append(status)
            return status in ok

        wait_until(answered, timeout, f"{url} to answer {' or '.join(map(str, ok))}", proc, log)
    return time.monotonic() - start


def _name(popen: subprocess.Popen) -> str:
    args = [popen.args] if isinstance(popen.args, (str, bytes, os.PathLike)) else list(popen.args)
    return " ".join(Path(str(a)).name if i == 0 else str(a) for i, a in enumerate(args[:4]))


def _with_output(headline: str, proc: Started | None) -> str:
    tail = proc.log_tail() if proc is not None else ""
    return f"{headline}; its last output:\n{tail}" if tail.strip() else headline


class ProcessExited(RuntimeError):
    """A started process exited while it was expected to run; the message ends with its log."""

    def __init__(self, proc: Started, waiting_for: str):
        self.proc = proc
        self.headline = (f"{proc.name} (pid {proc.pid}) exited with code {proc.popen.returncode} "
                         f"while waiting for {waiting_for}")
        super().__init__(_with_output(self.headline, proc))

    def last_error(self) -> str:
        """The most telling line of its log: the last 'error' line, else the last line."""
        lines = [line.strip() for line in self.proc.log_tail(8000).splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        return (errors or lines or ["(no output)"])[-1]


class WaitTimedOut(TimeoutError):
    """What was awaited did not come in time; the message ends with the watched process's log."""

    def __init__(self, headline: str, proc: Started | None):
        self.headline = headline
        super().__init__(_with_output(headline, proc))
