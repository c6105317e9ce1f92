"""Selfcheck wired to test-only workers: the launchers the tests hand to the scenario functions."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx

from vramledger.worker.memory.device import get_device
from vramledger.worker.selfcheck.context import Context
from vramledger.worker.selfcheck.processes import Processes
from vramledger.worker.selfcheck.scale import make_scale
from vramledger.worker.selfcheck.view import DeviceView
from vramledger.worker.selfcheck.workers import Launcher, WorkerProcess

HERE = Path(__file__).resolve().parent


class HoldingLauncher(Launcher):
    """Workers with the test-only route; each holds `mib` MiB outside its ledger once it is ready."""

    command = (sys.executable, str(HERE / "serve_with_hold_route.py"))

    def __init__(self, mib: int):
        super().__init__()
        self.mib = mib

    def wait_ready(self, worker: WorkerProcess, timeout: float) -> WorkerProcess:
        super().wait_ready(worker, timeout)
        httpx.post(worker.url + "/test/hold", params={"mib": self.mib}, timeout=60,
                   trust_env=False).raise_for_status()
        return worker


class DraftLeftOutLauncher(Launcher):
    """Workers whose memory plan leaves the draft out (seed 000)."""

    command = (sys.executable, str(HERE / "serve_draft_left_out.py"))


def cpu_context(workdir: Path, launcher: Launcher | None = None, **lengths: int) -> Context:
    """A selfcheck context on the CPU at the default scale, as `--device cpu` builds it; `lengths`
    (max_model_len, max_num_seqs) as the flags of the same names set them."""
    view = DeviceView(get_device("cpu"))
    scale = make_scale("cpu", "cpu", view.total_bytes(), 4, **lengths)
    return Context(view, scale, Processes(workdir), launcher=launcher or Launcher(), quiet=True)
