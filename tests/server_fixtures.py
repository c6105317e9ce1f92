"""Real `python -m vramledger.worker serve` processes on loopback ports, shared by the server test modules."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from vramledger.worker.selfcheck.processes import free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key-0123456789"
READY_TIMEOUT = 120.0  # seconds; loading + the memory profile run take ~10 s on 2 cores
CHAT_TEMPLATE = (  # ChatML, as the shipped pair uses
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass
class Server:
    """One worker process: its URL, its log, and the /health answers seen while it started."""

    name: str
    args: list[str]
    log_path: Path
    port: int = 0
    process: subprocess.Popen | None = None
    health_seen: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict | None = None) -> None:
        self.port = free_port()
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "vramledger.worker", "serve", "--port", str(self.port), *self.args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        wait_http(self.url + "/health", timeout, self.process, self.log_path, seen=self.health_seen)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""


@pytest.fixture
def gated_worker(checkpoints, tmp_path):
    """start(*serve_flags) -> (process, url, model name): a plain worker under
    tests/serve_with_step_gate.py, so the test decides when the engine steps; killed after the test."""
    procs = []

    def start(*flags: str):
        port, log_path = free_port(), tmp_path / f"worker-{len(procs)}.log"
        with open(log_path, "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "serve_with_step_gate.py"),
                                     "--model", checkpoints["llama"], "--no-draft", "--max-model-len", "128",
                                     "--port", str(port), *flags], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 180, proc, log_path)
        return proc, url, httpx.get(url + "/v1/models").json()["data"][0]["id"]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def with_chat_template(source: str, target: Path) -> str:
    """A copy of a checkpoint whose tokenizer has a chat template (the random ones have none)."""
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(target)


_servers: dict[str, Server] = {}


def servers(checkpoints: dict, workdir: Path) -> dict[str, Server]:
    """Start (once per test process) the two servers the tests use, in parallel.

    "spec": the llama target (with a chat template) and its draft, k fixed at 4, default limits.
    "plain": the same target without a draft, with an API key, one running request and one
    waiting slot (overload), and a short context (schemathesis stays fast).
    """
    if not _servers:
        target = with_chat_template(checkpoints["llama"], workdir / "llama-chat")
        # Fixed k: the metric tests count exactly K proposals per draft.
        _servers["spec"] = Server("spec", ["--model", target, "--draft-model", checkpoints["llama-draft"],
                                           "--speculation", "fixed"], workdir / "spec.log")
        _servers["plain"] = Server("plain", ["--model", target, "--no-draft", "--api-key", API_KEY,
                                             "--max-num-seqs", "1", "--max-waiting", "1", "--max-model-len", "64"],
                                   workdir / "plain.log")
        for server in _servers.values():
            server.start()
            atexit.register(server.stop)
        for server in _servers.values():
            server.wait_ready()
    return _servers


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """The value of one series in a text exposition, e.g. metric_value(t, "x_total", 'a="b"')."""
    series = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def sse_events(lines: list[str]) -> list[str]:
    """The data fields of a server-sent event stream, checking its framing on the way."""
    events, pending = [], None
    for line in lines:
        if line == "":
            assert pending is not None, "blank line without an event"
            events.append(pending)
            pending = None
        else:
            assert line.startswith("data: ") and pending is None, f"malformed SSE line {line!r}"
            pending = line[len("data: "):]
    assert pending is None, "stream ended inside an event"
    return events


# --- fixtures: test modules import these names ------------------------------------------------
@pytest.fixture(scope="session")
def spec_server(checkpoints, tmp_path_factory) -> Server:
    return servers(checkpoints, tmp_path_factory.mktemp("servers"))["spec"]


@pytest.fixture(scope="session")
def plain_server(checkpoints, tmp_path_factory) -> Server:
    return servers(checkpoints, tmp_path_factory.mktemp("servers"))["plain"]
