"""Worker, exporter and Prometheus as native processes on loopback (no Docker).

`make run` uses it to bring the stack up and print where to look; the end-to-end test uses
the same class, with a faster scrape and shorter alert delays.

Stopping: any terminating signal (Ctrl-C, SIGTERM, SIGHUP, ...) stops every service, each with
SIGTERM first (the worker drains its running requests) and SIGKILL after `STOP_TIMEOUT`. Each
service runs in a session of its own, so a terminal's Ctrl-C reaches only this launcher, and is
told by the kernel to stop if the launcher dies without cleaning up (even by SIGKILL).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a plain script: the repository's packages, installed or not
from vramledger.worker.selfcheck.processes import free_port, wait_http  # noqa: E402

STOP_TIMEOUT = 45.0  # seconds: above the worker's default --drain-timeout (30 s)
# Signals whose default action ends a process; SIGKILL and SIGSTOP cannot be caught (the children's
# parent-death signal covers SIGKILL).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGALRM)
PR_SET_PDEATHSIG = 1


class Stopped(Exception):
    """Raised by StopSignals.check() once a stop signal has come."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def die_with(parent: int):
    """A preexec_fn: the child gets SIGTERM when `parent` dies (Linux), and quits if it already has."""
    def preexec() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


VLLM_JOB = "  # - job_name: vllm"  # prometheus/prometheus.yml's commented-out scrape of vLLM's /metrics


def with_vllm_job(config: str, targets: list[str] | None = None) -> str:
    """prometheus.yml with its `vllm` job switched on (uncommented), scraping `targets` (host:port;
    None keeps the file's, docker-compose.yml's vLLM example)."""
    lines = config.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == VLLM_JOB)
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    job = "".join("  " + line[4:] for line in lines[start:end])
    if targets is not None:
        job = re.sub(r"targets: \[.*\]", "targets: [%s]" % ", ".join(f'"{t}"' for t in targets), job)
    return "".join(lines[:start]) + job + "".join(lines[end:])


class LocalStack:
    """Starts and stops the three processes; state lives in `workdir`. Each vLLM server of `vllm_urls`
    (already running) is watched by the exporter, and its own /metrics scraped by Prometheus."""

    def __init__(self, workdir: Path, worker_args: list[str] = (),
                 exporter_args: list[str] = ("--min-process-memory", "1GiB"), scrape_interval: str = "5s",
                 rule_for: str | None = None, ports: dict[str, int] | None = None,
                 check: Callable[[], None] = lambda: None, vllm_urls: list[str] = ()):
        self.workdir = Path(workdir)
        self.worker_args = list(worker_args)
        self.vllm_urls = list(vllm_urls)
        # On a CPU host every process uses RAM: only big ones are worth calling foreign.
        self.exporter_args = list(exporter_args) + [a for url in self.vllm_urls for a in ("--vllm", url)]
        self.scrape_interval = scrape_interval
        self.rule_for = rule_for  # shorten every alert's `for:` (tests)
        self.ports = ports or {"worker": free_port(), "exporter": free_port(), "prometheus": free_port()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.check = check  # runs while start() waits: it may raise to stop waiting

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self, timeout: float = 300) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        self._serve("worker", [py, "-m", "vramledger.worker", "serve", "--port", str(self.ports["worker"]), *self.worker_args],
                    "/health", timeout)
        self._serve("exporter", [py, "-m", "vramledger.exporter", "--backend", "auto", "--port", str(self.ports["exporter"]),
                                 "--worker", self.url("worker"), *self.exporter_args], "/metrics", 60)
        config = self._write_prometheus_config()
        self._serve("prometheus", [shutil.which("prometheus") or "prometheus", f"--config.file={config}",
                                   f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{self.ports['prometheus']}"], "/-/ready", 60)

    def _serve(self, name: str, cmd: list[str], ready_path: str, timeout: float) -> None:
        """Start one service and wait until ready_path answers 200 (failing at once if it exits)."""
        with open(self.log(name), "wb") as out:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                                start_new_session=True, preexec_fn=die_with(os.getpid()))
        wait_http(self.url(name) + ready_path, timeout, self.procs[name], self.log(name), check=self.check)

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def _write_prometheus_config(self) -> Path:
        """The repo's rules, with the compose hostnames replaced by loopback ports."""
        rules_dir = self.workdir / "rules"
        rules_dir.mkdir(exist_ok=True)
        for rules in (ROOT / "prometheus" / "rules").glob("*.yml"):
            text = rules.read_text()
            if self.rule_for:
                text = re.sub(r"(\n\s+for:\s*)\S+", rf"\g<1>{self.rule_for}", text)
            (rules_dir / rules.name).write_text(text)
        text = (ROOT / "prometheus" / "prometheus.yml").read_text()
        text = text.replace("worker:8000", f"127.0.0.1:{self.ports['worker']}")
        text = text.replace("exporter:9400", f"127.0.0.1:{self.ports['exporter']}")
        text = text.replace("localhost:9090", f"127.0.0.1:{self.ports['prometheus']}")
        text = re.sub(r"scrape_interval: \S+", f"scrape_interval: {self.scrape_interval}", text)
        text = re.sub(r"evaluation_interval: \S+", f"evaluation_interval: {self.scrape_interval}", text)
        text = re.sub(r"scrape_timeout: \S+", f"scrape_timeout: {self.scrape_interval}", text)
        text = re.sub(r"alerting:\n(  .*\n)+", "", text)  # no Alertmanager natively; alerts show in Prometheus
        if self.vllm_urls:
            text = with_vllm_job(text, [urlsplit(url).netloc for url in self.vllm_urls])
        config = self.workdir / "prometheus.yml"
        config.write_text(text)
        return config

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM to every service, SIGKILL to what is left after `timeout`; each one's process group
        is killed too, so nothing a service started outlives it."""
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{proc.args[:3]} did not stop in {timeout:.0f} s: killed", file=sys.stderr)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the service leads its own session and group
    except (ProcessLookupError, PermissionError):
        pass


class StopSignals:
    """Records the first stop signal; check() raises Stopped once one has come.

    The handler only records: an exception raised in a handler can surface inside a finalizer or a
    weakref callback (an import lock's, seen in a test), where Python prints it and drops it, and the
    launcher would run on without its services ever being stopped."""

    def __init__(self):
        self.signum: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Stopped(self.signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default=str(ROOT / ".run"))
    ap.add_argument("--worker-port", type=int, default=8000)
    ap.add_argument("--exporter-port", type=int, default=9400)
    ap.add_argument("--prometheus-port", type=int, default=9090)
    ap.add_argument("--vllm", action="append", default=[], metavar="URL",
                    help="a running vLLM server to watch: the exporter reads its memory, Prometheus scrapes its "
                         "own /metrics (repeatable)")
    ap.add_argument("worker_args", nargs="*", help="extra flags for `python -m vramledger.worker serve` (after --)")
    args = ap.parse_args()
    ports = {"worker": args.worker_port, "exporter": args.exporter_port, "prometheus": args.prometheus_port}
    stop_signals = StopSignals()
    stack = LocalStack(Path(args.workdir), args.worker_args, ports=ports, check=stop_signals.check,
                       vllm_urls=args.vllm)
    print("starting worker, exporter and Prometheus (logs in %s) ..." % args.workdir, flush=True)
    try:
        stack.start()
        model = httpx.get(stack.url("worker") + "/v1/models").json()["data"][0]["id"]
        watched = "".join(f"\n  vLLM (watched)  {url}/metrics" for url in args.vllm)
        print(f"""
vramledger is up:
  OpenAI API      {stack.url('worker')}/v1/completions, /v1/chat/completions, /v1/models
  memory ledger   {stack.url('worker')}/v1/memory
  worker metrics  {stack.url('worker')}/metrics
  exporter        {stack.url('exporter')}/metrics
  Prometheus      {stack.url('prometheus')}  (alerts: /alerts, rules: /rules){watched}
try: curl -s {stack.url('worker')}/v1/completions -H 'content-type: application/json' \\
       -d '{{"model": "{model}", "prompt": "import os\\nimport sys\\n\\n\\ndef main(argv):\\n", "max_tokens": 40, "temperature": 0}}'
Ctrl-C (or SIGTERM) stops everything.""", flush=True)
        while all(p.poll() is None for p in stack.procs.values()):
            stop_signals.check()
            time.sleep(0.2)
        dead = [n for n, p in stack.procs.items() if p.poll() is not None]
        print(f"{', '.join(dead)} exited; see {args.workdir}/*.log", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(f"{stop}: stopping worker, exporter and Prometheus ...", file=sys.stderr, flush=True)
        return 0 if stop.signum in (signal.SIGINT, signal.SIGTERM) else 128 + stop.signum
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}; see {args.workdir}/*.log", file=sys.stderr)
        return 1
    finally:
        for sig in STOP_SIGNALS:  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
