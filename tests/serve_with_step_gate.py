"""`python -m vramledger.worker serve` wrapped for the tests: engine steps run only as the test allows.

POST /test/steps?n=N lets N more steps run (n=-1: all from now on), so a test can hold requests
in flight for as long as it needs, without depending on how fast the machine generates.
Stopping the engine loop opens the gate, so a held engine never blocks shutdown.

    python tests/serve_with_step_gate.py [serve flags...]
"""
from __future__ import annotations

import sys
import threading

from fastapi import FastAPI

from vramledger.worker import cli
from vramledger.worker.http import server
from vramledger.worker.http.engine_loop import EngineLoop

permits = threading.Semaphore(0)
opened = threading.Event()


def gated(step):
    def gated_step(self: EngineLoop):
        # Steps hold their outputs until the next one's kernel starts: a shut gate hands them out first.
        self._post_held()
        while not opened.is_set() and not permits.acquire(timeout=0.05):
            pass
        return step(self)
    return gated_step


def opening(stop):
    def opening_stop(self, *args, **kwargs):
        opened.set()
        return stop(self, *args, **kwargs)
    return opening_stop


def with_gate_route(app: FastAPI) -> FastAPI:
    @app.post("/test/steps", include_in_schema=False)
    async def steps(n: int) -> dict:
        if n < 0:
            opened.set()
        else:
            permits.release(n)
        return {"opened": opened.is_set()}

    return app


if __name__ == "__main__":
    EngineLoop._step = gated(EngineLoop._step)
    EngineLoop.stop = opening(EngineLoop.stop)
    real_create_app = server.create_app
    server.create_app = lambda *args, **kwargs: with_gate_route(real_create_app(*args, **kwargs))
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
