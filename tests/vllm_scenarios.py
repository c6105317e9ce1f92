"""tests/vllm_cuda_path.py's scenarios for the test modules, through one fork server a session
(tests/vllm_fork_server.py): vLLM imported once, the scenarios run side by side, and each set of
arguments run once, since on the faked device a scenario's result depends on its arguments alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_peer  # noqa: E402

TIMEOUT_S = 600  # for one scenario, from the moment its result is asked for


class ScenarioRun:
    """One scenario's process, read as a subprocess.Popen is: poll(), communicate(), returncode, kill()."""

    def __init__(self, server: ScenarioServer, run_id: str, folder: Path):
        self.server, self.run_id = server, run_id
        self.out, self.err = folder / "stdout", folder / "stderr"
        self.returncode: int | None = None

    def poll(self) -> int | None:
        status = Path(f"{self.out}.rc")
        if self.returncode is None and status.exists():
            self.returncode = int(status.read_text())
        return self.returncode

    def communicate(self, timeout: float = TIMEOUT_S) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            self.server.check_alive()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"scenario {self.run_id}", timeout)
            time.sleep(0.05)
        return self.out.read_text(), self.err.read_text()

    def kill(self) -> None:
        self.server.send({"kill": self.run_id})


class ScenarioServer:
    """The fork server, and the runs asked of it: one for each set of arguments."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
        self.log = folder / "fork-server.log"
        with open(self.log, "w") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [str(vllm_peer.vllm_python()), str(ROOT / "tests" / "vllm_fork_server.py")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env, cwd=folder)
        if self.process.stdout.readline().strip() != "ready":
            self.process.wait(timeout=30)
            raise RuntimeError(f"the fork server did not start:\n{self.log.read_text()[-4000:]}")
        self.runs: dict[tuple, ScenarioRun] = {}
        self.started = 0

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the fork server exited ({self.process.returncode}):\n"
                               f"{self.log.read_text()[-4000:]}")

    def send(self, request: dict) -> None:
        self.check_alive()
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def start(self, scenario: str, *args: str, sizing: str = "vllm") -> ScenarioRun:
        """tests/vllm_cuda_path.py SCENARIO ARGS, the plugin's sizing set to `sizing`: started unless it was."""
        key = (scenario, args, sizing)
        if key not in self.runs:
            run_id, self.started = f"{self.started:02d}-{scenario}", self.started + 1
            folder = self.folder / run_id
            folder.mkdir()
            run = ScenarioRun(self, run_id, folder)
            self.send({"run": run_id, "argv": [scenario, *args], "env": {"VRAMLEDGER_VLLM_SIZING": sizing},
                       "cwd": str(folder), "out": str(run.out), "err": str(run.err)})
            self.runs[key] = run
        return self.runs[key]

    def stop_unread(self) -> None:
        """Kills the runs still going (those of tests not selected) and forgets them: a module's runs
        end with it."""
        for key, run in list(self.runs.items()):
            if run.poll() is None:
                run.kill()
                del self.runs[key]

    def result(self, scenario: str, *args: str, sizing: str = "vllm") -> dict:
        return finish(self.start(scenario, *args, sizing=sizing))

    def close(self) -> None:
        self.process.stdin.close()  # it kills what still runs, and exits
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def finish(run: ScenarioRun) -> dict:
    """The scenario's result, with "log" (its stdout and stderr); it must have started."""
    out, err = run.communicate()
    assert run.returncode == 0, err[-4000:]
    return dict(json.loads(out.strip().splitlines()[-1]), log=out + err)


@pytest.fixture(scope="session")
def cuda_path(tmp_path_factory):
    """The session's ScenarioServer (needs the vLLM venv: its modules skip without one)."""
    server = ScenarioServer(tmp_path_factory.mktemp("vllm-cuda-path"))
    yield server
    server.close()
