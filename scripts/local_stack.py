"""Worker, exporter and Prometheus as native processes on loopback (no Docker).

`make run` uses it to bring the stack up and print where to look; the end-to-end test uses
the same class, with a faster scrape and shorter alert delays.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, ok=(200,)) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


class LocalStack:
    """Starts and stops the three processes; state lives in `workdir`."""

    def __init__(self, workdir: Path, worker_args: list[str] = (),
                 exporter_args: list[str] = ("--min-process-memory", "1GiB"), scrape_interval: str = "5s",
                 rule_for: str | None = None, ports: dict[str, int] | None = None):
        self.workdir = Path(workdir)
        self.worker_args = list(worker_args)
        # On a CPU host every process uses RAM: only big ones are worth calling foreign.
        self.exporter_args = list(exporter_args)
        self.scrape_interval = scrape_interval
        self.rule_for = rule_for  # shorten every alert's `for:` (tests)
        self.ports = ports or {"worker": free_port(), "exporter": free_port(), "prometheus": free_port()}
        self.procs: dict[str, subprocess.Popen] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self, timeout: float = 300) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        self._spawn("worker", [py, "-m", "worker", "serve", "--port", str(self.ports["worker"]), *self.worker_args])
        wait_http(self.url("worker") + "/health", timeout, self.procs["worker"])
        self._spawn("exporter", [py, "-m", "exporter", "--backend", "auto", "--port", str(self.ports["exporter"]),
                                 "--worker", self.url("worker"), *self.exporter_args])
        wait_http(self.url("exporter") + "/metrics", 60, self.procs["exporter"])
        config = self._write_prometheus_config()
        self._spawn("prometheus", [shutil.which("prometheus") or "prometheus", f"--config.file={config}",
                                   f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{self.ports['prometheus']}"])
        wait_http(self.url("prometheus") + "/-/ready", 60, self.procs["prometheus"])

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

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
        config = self.workdir / "prometheus.yml"
        config.write_text(text)
        return config

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default=str(ROOT / ".run"))
    ap.add_argument("worker_args", nargs="*", help="extra flags for `python -m worker serve` (after --)")
    args = ap.parse_args()
    ports = {"worker": 8000, "exporter": 9400, "prometheus": 9090}
    stack = LocalStack(Path(args.workdir), args.worker_args, ports=ports)
    print("starting worker, exporter and Prometheus (logs in %s) ..." % args.workdir, flush=True)
    try:
        stack.start()
        model = httpx.get(stack.url("worker") + "/v1/models").json()["data"][0]["id"]
        print(f"""
vramledger is up:
  OpenAI API      {stack.url('worker')}/v1/completions, /v1/chat/completions, /v1/models
  memory ledger   {stack.url('worker')}/v1/memory
  worker metrics  {stack.url('worker')}/metrics
  exporter        {stack.url('exporter')}/metrics
  Prometheus      {stack.url('prometheus')}  (alerts: /alerts, rules: /rules)
try: curl -s {stack.url('worker')}/v1/completions -H 'content-type: application/json' \\
       -d '{{"model": "{model}", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}}'
Ctrl-C stops everything.""", flush=True)
        while all(p.poll() is None for p in stack.procs.values()):
            time.sleep(1)
        dead = [n for n, p in stack.procs.items() if p.poll() is not None]
        print(f"{', '.join(dead)} exited; see {args.workdir}/*.log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}; see {args.workdir}/*.log", file=sys.stderr)
        return 1
    finally:
        stack.stop()


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
