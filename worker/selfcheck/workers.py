"""A worker process (`python -m vramledger.worker serve`) on a loopback port, and how selfcheck launches one."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from vramledger.ledger_document import LedgerDocument
from vramledger.ledger_reading import LedgerError, parse_ledger
from vramledger.worker.selfcheck.processes import Processes, Started, free_port, wait_http

# The children listen on loopback only, without the API key the user may have set for real servers.
_DROPPED_ENV = ("VRAMLEDGER_API_KEY", "VRAMLEDGER_METRICS_AUTH")
T = TypeVar("T")


@dataclass
class WorkerProcess:
    """A started worker: its process, its URL, and its ledger (GET /v1/memory, docs/ledger.md)."""

    name: str
    proc: Started
    port: int
    started_at: float = field(default_factory=time.monotonic)
    ready_seconds: float | None = None  # from the start to /health 200
    _client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30, trust_env=False))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> dict:
        response = self._client.get(self.url + path)
        response.raise_for_status()
        return response.json()

    def ledger(self) -> LedgerDocument:
        """Its ledger, read as every reader does; a document the reader refuses raises LedgerError
        naming the worker and the field."""
        return read_ledger(self.name, self.get("/v1/memory"))

    def model_id(self) -> str:
        return self.get("/v1/models")["data"][0]["id"]

    def close(self) -> None:
        self._client.close()


def read_ledger(name: str, document: object) -> LedgerDocument:
    try:
        return parse_ledger(document)
    except LedgerError as e:
        raise LedgerError(f"{name}'s GET /v1/memory is no ledger: {e}") from e


def needed(value: T | None, what: str) -> T:
    """A figure the ledger may leave null (or out) that a check cannot do without: a LedgerError if it does."""
    if value is None:
        raise LedgerError(f"the worker's ledger gives no {what}, which the check needs")
    return value


class Launcher:
    """Starts workers as `python -m vramledger.worker serve --port P --host 127.0.0.1 FLAGS`.

    `command` is what runs before the flags; another launcher (another command, or another way of
    waiting) is passed to the scenario functions directly, never chosen by a flag.
    """

    command: tuple[str, ...] = (sys.executable, "-m", "vramledger.worker", "serve")

    def start(self, procs: Processes, name: str, flags: list[str], env: dict[str, str] | None = None
              ) -> WorkerProcess:
        """Spawn the worker and return at once; wait_ready() waits for it."""
        port = free_port()
        proc = procs.start(name, [*self.command, "--host", "127.0.0.1", "--port", str(port), *flags],
                           env=env, drop_env=_DROPPED_ENV)
        return WorkerProcess(name, proc, port)

    def wait_ready(self, worker: WorkerProcess, timeout: float) -> WorkerProcess:
        """Wait until /health answers 200; raises ProcessExited when the worker exits instead."""
        wait_http(worker.url + "/health", timeout, worker.proc)
        worker.ready_seconds = time.monotonic() - worker.started_at
        return worker
