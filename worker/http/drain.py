"""Graceful stop: on SIGTERM the worker stops admitting, lets running requests finish, then exits 0.

A rollout sends SIGTERM while clients still hold requests, and the Service may route new ones here
for a few seconds more. So the listener stays open during the drain: /health answers 503 (the pod
leaves the endpoints), a new generation request gets 503 with Retry-After (the client retries on
another replica), and each running request finishes. Whatever still runs at --drain-timeout ends
with finish_reason "abort" and its blocks are freed; then uvicorn shuts down as usual.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from vramledger.worker.http.engine_loop import EngineLoop
from vramledger.worker.http.errors import error_body, send_json
from vramledger.worker.http.settings import ABORT_GRACE

log = logging.getLogger(__name__)
RETRY_AFTER = "5"  # seconds; a client's retry then lands on a replica that is not draining


class Drain:
    """The drain state shared by the HTTP gate and the server: draining flag and requests in flight."""

    def __init__(self, engine_loop: EngineLoop, timeout: float = 30.0):
        if timeout < 0:
            raise ValueError("--drain-timeout must be >= 0")
        self.engine_loop = engine_loop
        self.timeout = timeout
        self.draining = False
        self.in_flight = 0  # generation requests admitted and not yet answered in full
        self.aborted = 0
        self._deadline = 0.0
        self._task: asyncio.Task | None = None  # held: the loop keeps only a weak reference

    def begin(self, on_drained) -> None:
        """Start draining (on the event loop); `on_drained()` runs once nothing is left in flight."""
        if self.draining:
            return
        self.draining = True
        self._deadline = time.monotonic() + self.timeout
        log.info("SIGTERM: draining %d running request(s) for up to %.0f s; new requests get 503",
                 self.in_flight, self.timeout)
        self._task = asyncio.ensure_future(self._wait(on_drained))

    def hurry(self) -> None:
        """A second SIGTERM: end the drain now."""
        self._deadline = time.monotonic()

    async def _wait(self, on_drained) -> None:
        while self.in_flight and time.monotonic() < self._deadline:
            await asyncio.sleep(0.05)
        # Past the deadline: abort what runs (again, for any request that was still being tokenized),
        # and give the aborted ones a moment to send their last chunk.
        grace_end = time.monotonic() + ABORT_GRACE
        while self.in_flight and time.monotonic() < grace_end:
            aborted = self.engine_loop.abort_all("abort")
            if aborted:
                self.aborted += aborted
                log.warning("drain timeout (%.0f s): aborted %d request(s) with finish_reason 'abort'",
                            self.timeout, aborted)
            await asyncio.sleep(0.05)
        log.info("drained (%d aborted); shutting down", self.aborted)
        on_drained()


def is_generation(scope) -> bool:
    return scope["method"] == "POST" and scope["path"].startswith("/v1/")


class DrainGate:
    """ASGI layer: counts generation requests in flight; while draining, /health and new ones get 503.

    GET /v1/memory, /v1/models and /metrics keep answering: the exporter and Prometheus still read
    the worker while it drains.
    """

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining:
            if scope["path"] == "/health":
                return await _send_503(send, "draining", "the worker is shutting down", "draining")
            if is_generation(scope):
                return await _send_503(send, None, "the worker is shutting down; retry on another replica",
                                       "shutting_down")
        if not is_generation(scope):
            return await self.app(scope, receive, send)
        self.drain.in_flight += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


async def _send_503(send, status: str | None, message: str, code: str) -> None:
    body = error_body(message, "server_error", None, code)
    if status is not None:  # /health's shape: {"status": ..., "error": ...}
        body = {"status": status, **body}
    await send_json(send, 503, body, {"retry-after": RETRY_AFTER, "connection": "close"})


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first and the process then exits 0 (not by the signal)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self._loop is None or self.should_exit:
            return super().handle_exit(sig, frame)  # SIGINT: uvicorn's own stop
        if self.drain.draining:
            self.drain.hurry()
        else:  # a signal handler may interrupt the loop anywhere: hand over through the thread-safe call
            self._loop.call_soon_threadsafe(self.drain.begin, self._exit)

    def _exit(self) -> None:
        self.should_exit = True
