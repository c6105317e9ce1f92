"""The one thread that owns the engine: it loads it, then adds, aborts and steps requests.

The engine is not thread-safe. The asyncio side never touches it: it sends commands through a
queue guarded by a condition (the thread sleeps on it when idle), receives each step's outputs
through `loop.call_soon_threadsafe`, one call per step, into one asyncio.Queue per request, and
reads queue lengths and blocks from the snapshot the engine publishes after each change
(worker/engine/snapshot.py), never from its scheduler, block pool or runner.

On the CPU a step's outputs are posted as the next step's one-call kernel starts, where it leaves a
core free (ModelRunner.on_compute), not as the step ends: the event loop's work on them (a chunk for
each stream) then runs while the kernel holds no GIL. Posted as the step ended, that work took the
GIL at the next step's first torch call and held it against the step's own Python: a served decode
step's forward slept about 1 ms outside the kernel. Outputs no such kernel follows (the last
step's, or a step that ran none, as every step off the CPU) are posted as their step ends.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from vramledger.worker.engine.outputs import RequestOutput
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.snapshot import EngineSnapshot
from vramledger.worker.http.metrics import RequestMetrics

if TYPE_CHECKING:
    from vramledger.worker.engine.llm_engine import (
        LLMEngine,  # typing only: importing it loads torch and the models
    )

log = logging.getLogger(__name__)


class EngineFailed(RuntimeError):
    """Delivered to a request's stream when the engine could not take or finish it."""


class EngineLoop:
    """Owns the LLMEngine on a background thread; requests and aborts reach it as commands."""

    def __init__(self, build: Callable[[], LLMEngine], metrics: RequestMetrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self._build = build
        self.metrics = metrics
        self.on_fatal = on_fatal  # called on the engine thread when loading or a step fails
        self.engine: LLMEngine | None = None  # set once loaded: the asyncio side reads it for validation and gauges
        self.error: BaseException | None = None
        self._wake = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._pending_adds = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue] = {}  # asyncio thread only
        self._output_tokens: dict[str, int] = {}  # asyncio thread only: tokens delivered so far
        self._held: list[tuple[list[RequestOutput], float]] = []  # engine thread: outputs, step start
        self._computed = False  # engine thread: whether a kernel of the current step took the held outputs

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        self._aloop = aloop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the current step and end the thread; a thread still loading is left (a daemon): it
        ends when the load does, without stepping or reporting a failure."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None and self.engine is not None:
            self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.error is None

    # -- the asyncio side ------------------------------------------------------------------
    def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
               arrival: float, group: str = "") -> asyncio.Queue:
        """Queue a request (one choice of `group`, when given); its RequestOutputs (or an EngineFailed)
        arrive on the returned queue."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(("add", request_id, token_ids, params, arrival, group), add=True)
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; a finished or unknown request is ignored."""
        self._output_tokens.pop(request_id, None)
        if self._streams.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def abort_all(self, reason: str) -> int:
        """End every request now with a last output carrying `reason` (the drain's deadline)."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            stream = self._streams[request_id]
            tokens = self._output_tokens.get(request_id, 0)
            last = RequestOutput(request_id, new_token_ids=[], text="", finished=True, finish_reason=reason,
                                 num_prompt_tokens=0, num_output_tokens=tokens, num_draft_tokens=0,
                                 num_accepted_tokens=0)
            self.abort(request_id)
            stream.put_nowait(last)
        return len(request_ids)

    def num_pending(self) -> int:
        """Requests submitted that the engine thread has not yet queued in its scheduler."""
        return self._pending_adds

    def num_waiting(self) -> int:
        snapshot = self.snapshot()
        return self._pending_adds + (snapshot.requests_waiting if snapshot is not None else 0)

    def snapshot(self) -> EngineSnapshot | None:
        """The engine's latest published state (worker/engine/snapshot.py); None while it loads."""
        engine = self.engine
        return engine.snapshot if engine is not None else None

    def _send(self, command: tuple, add: bool = False) -> None:
        with self._wake:
            self._commands.append(command)
            self._pending_adds += add
            self._wake.notify()

    def _deliver(self, items: list[tuple[str, RequestOutput | EngineFailed]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # the client went away; its abort is on the way
            if isinstance(item, EngineFailed) or item.finished:
                del self._streams[request_id]
                self._output_tokens.pop(request_id, None)
            else:
                self._output_tokens[request_id] = item.num_output_tokens
            stream.put_nowait(item)

    def _fail_all(self, error: EngineFailed) -> None:
        self._deliver([(request_id, error) for request_id in list(self._streams)])

    # -- the engine thread -----------------------------------------------------------------
    def _post(self, callback, argument) -> None:
        if self._aloop is None:
            return  # never started: nobody to tell
        try:
            self._aloop.call_soon_threadsafe(callback, argument)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down

    def _run(self) -> None:
        started = time.monotonic()
        try:
            engine = self._build()
        except Exception as exc:  # noqa: BLE001 - reported and handed to on_fatal
            if self._stopping:  # the server shut down mid-load (and took the tokenizer's threads): no fault
                log.info("the server stopped while the engine loaded: %s", exc)
                return
            log.error("the engine could not be loaded: %s", exc)
            self._die(exc)
            return
        if self._stopping:
            log.info("the server stopped while the engine loaded")
            return
        self.engine = engine
        engine.on_compute(self._on_compute)
        log.info("engine ready in %.1f s", time.monotonic() - started)
        try:
            while (commands := self._next_commands()) is not None:
                self._apply(commands)
                if engine.has_unfinished_requests():
                    self._step()
        except Exception as exc:  # a failed step fails every request, then the server
            log.exception("engine step failed; failing all requests")
            self._post_held()  # the steps before it finished: their tokens go out first
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        self._post(self._fail_all, EngineFailed(f"the engine failed: {type(exc).__name__}"))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    @property
    def _loaded(self) -> LLMEngine:
        """The engine, on the engine thread once it has loaded (the only place these run)."""
        assert self.engine is not None, "the engine thread steps only a loaded engine"
        return self.engine

    def _next_commands(self) -> list[tuple] | None:
        """Wait until there is a command or a request to step (no busy spin); None to stop."""
        with self._wake:
            while not (self._commands or self._stopping or self._loaded.has_unfinished_requests()):
                self._wake.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, commands: list[tuple]) -> None:
        failed = []
        for command in commands:
            if command[0] == "add":
                _, request_id, token_ids, params, arrival, group = command
                try:
                    self._loaded.add_request(token_ids, params, request_id, group)
                    if self.metrics is not None:
                        self.metrics.added(request_id, arrival)
                except ValueError as exc:  # the server validates first; this is the last guard
                    failed.append((request_id, EngineFailed(str(exc))))
                with self._wake:
                    self._pending_adds -= 1
            else:
                if self.metrics is not None:  # counted first: a scrape that sees the blocks freed sees it
                    self.metrics.aborted(command[1])
                self._loaded.abort_request(command[1])
        if failed:
            self._post(self._deliver, failed)

    def _step(self) -> None:
        started = time.monotonic()
        self._computed = False
        # A speculative step's prompts get their first tokens before its proposals run.
        outputs = self._loaded.step(early=lambda outputs: self._held.append((outputs, started)))
        self._held.append((outputs, started))
        if not self._computed or not self._loaded.has_unfinished_requests():
            self._post_held()  # no forward of this step or the next will post them

    def _on_compute(self) -> None:
        self._computed = True
        self._post_held()

    def _post_held(self) -> None:
        """Hand the held outputs to the event loop, in one call (observed first: the call wakes it)."""
        held, self._held = self._held, []
        if self.metrics is not None:
            posted = time.monotonic()
            for outputs, started in held:
                self.metrics.step(outputs, started, posted)
        items = [(out.request_id, out) for outputs, _ in held for out in outputs]
        if items:
            self._post(self._deliver, items)
