"""Start-up phases: each is logged as it begins and as it ends, with its duration, and kept for the
worker's /metrics (`vramledger_startup_seconds{phase}`). Imports nothing but the standard library, so
that the command line and the HTTP server time their own phases with it before torch is loaded."""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterable, Iterator

log = logging.getLogger(__name__)


class StartupPhases:
    """Seconds per phase, in the order they began; a phase run twice (a second tokenizer) adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._began: dict[str, float] = {}

    def begin(self, name: str) -> None:
        """For a phase that ends in another function than it began in (the HTTP server's); else `phase`."""
        log.info("start-up: %s ...", name)
        self._began[name] = time.perf_counter()

    def end(self, name: str) -> None:
        """Ends a phase begun with `begin`; a phase never begun (an app started without `begin`) is ignored."""
        began = self._began.pop(name, None)
        if began is None:
            return
        took = time.perf_counter() - began
        self.seconds[name] = self.seconds.get(name, 0.0) + took
        log.info("start-up: %s done in %.2f s", name, took)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as phase `name`; a block that raises is logged as failed and not kept."""
        self.begin(name)
        try:
            yield
        except BaseException:
            log.info("start-up: %s failed after %.2f s", name, time.perf_counter() - self._began.pop(name))
            raise
        self.end(name)


def merged(phases: Iterable[StartupPhases]) -> dict[str, float]:
    """The seconds of several timers' phases (the server's and its engine's), summed per phase name."""
    total: dict[str, float] = {}
    for timer in phases:
        for name, seconds in timer.seconds.items():
            total[name] = total.get(name, 0.0) + seconds
    return total


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector stays off inside, and every object alive at the end is frozen
    (gc.freeze: later collections skip them). Importing torch (and transformers) made half a million
    objects that live as long as the process, and the collections they triggered (several full ones,
    each walking everything imported so far) took a sixth of the imports' time; one full collection
    after them still took a tenth. The few thousand objects in garbage cycles among them (no RSS one
    can measure) are freed by the first full collection after the engine's load unfreezes them
    (collecting_only_new_objects). A collector that was already off stays off."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
