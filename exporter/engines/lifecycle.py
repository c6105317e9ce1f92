"""Each watched engine's lifecycle: its status in each scrape, and one log line each time it changes."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from vramledger.exporter.engines.base import EngineState, Status
from vramledger.exporter.errors import one_line

log = logging.getLogger("vramledger.exporter.engines")
_LEVEL = {Status.SERVING: logging.INFO, Status.LOADING: logging.INFO, Status.UNREACHABLE: logging.WARNING,
          Status.WRONG: logging.WARNING}


@dataclass(frozen=True)
class Reading:
    """One engine in one scrape: its status, what it told while serving, and why when not."""
    status: Status
    state: EngineState | None = None  # set when serving
    reason: str = ""
    wrong_kind: bool = False  # another kind of engine; the reason names the flag to watch it with
    counted: bool = False  # a fault, counted in vramledger_exporter_errors_total (every wrong reading)


class Lifecycle:
    """The status of one engine across scrapes; logs a line on each change, never one per scrape."""

    def __init__(self, kind: str, url: str, clock=time.monotonic):
        self.name = f"{kind} {url}"
        self.status: Status | None = None
        self._clock = clock
        self._away_since: float | None = clock()  # when it stopped serving (or watching began)
        self._served = False

    def update(self, reading: Reading) -> None:
        if reading.status is self.status:
            return
        now = self._clock()
        if reading.status is Status.SERVING:
            away = now - self._away_since
            if self._served:
                log.info("%s: serving again after %.1f s away", self.name, away)
            else:
                log.info("%s: serving (%.1f s after watching began)", self.name, away)
            self._served, self._away_since = True, None
        else:
            if self.status is Status.SERVING:
                self._away_since = now
            log.log(_LEVEL[reading.status], "%s: %s: %s", self.name, reading.status.value,
                    one_line(reading.reason))
        self.status = reading.status
