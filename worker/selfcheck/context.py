"""What every scenario gets: the device view, the sizes, the launcher, and the process registry."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vramledger.worker.selfcheck.checkpoints import read_config
from vramledger.worker.selfcheck.processes import Processes
from vramledger.worker.selfcheck.scale import Scale
from vramledger.worker.selfcheck.view import DeviceView
from vramledger.worker.selfcheck.workers import Launcher, WorkerProcess


@dataclass
class Context:
    """One selfcheck run. Scenarios start what they need through `procs`, which stops it all at the end."""

    view: DeviceView
    scale: Scale
    procs: Processes
    launcher: Launcher = field(default_factory=Launcher)
    quiet: bool = False
    vllm_python: str | None = None  # scenario 5: vLLM's interpreter (None: this one, if it has vLLM)

    @property
    def workdir(self) -> Path:
        return self.procs.workdir

    def say(self, message: str) -> None:
        """Progress, on stderr: stdout carries the table or the JSON."""
        if not self.quiet:
            print(f"selfcheck: {message}", file=sys.stderr, flush=True)

    def start_worker(self, name: str, flags: list[str], launcher: Launcher | None = None) -> WorkerProcess:
        return (launcher or self.launcher).start(self.procs, name, flags, env=self.scale.env())

    def wait_ready(self, worker: WorkerProcess, launcher: Launcher | None = None) -> WorkerProcess:
        return (launcher or self.launcher).wait_ready(worker, self.scale.ready_timeout)

    def stop(self, worker: WorkerProcess) -> None:
        worker.close()
        self.procs.stop(worker.proc)

    @contextlib.contextmanager
    def worker(self, name: str, flags: list[str]) -> Iterator[WorkerProcess]:
        """A ready worker for the block, stopped when it ends (however it ends)."""
        worker = self.start_worker(name, flags)
        try:
            yield self.wait_ready(worker)
        finally:
            self.stop(worker)

    def vocab_size(self) -> int:
        return min(read_config(path)["vocab_size"] for path in (self.scale.model, self.scale.draft_model))
