"""Error accounting for the exporter: every error counted, each kind logged once, on one line."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class ErrorLog:
    """Counts errors per source and logs each (source, kind) once, so a lasting fault cannot flood the log."""

    def __init__(self, sources: tuple[str, ...] = ()):
        self._lock = threading.Lock()  # ledger fetches record from several threads
        self._counts: dict[str, int] = dict.fromkeys(sources, 0)
        self._logged: set[tuple[str, str]] = set()

    def record(self, source: str, kind: str, message: str) -> None:
        """An error: counted in vramledger_exporter_errors_total{source}, logged the first time."""
        self.count(source)
        self.note(source, kind, message)

    def count(self, source: str) -> None:
        """An error logged elsewhere (an engine's state change logs its own line): counted only."""
        with self._lock:
            self._counts[source] = self._counts.get(source, 0) + 1

    def note(self, source: str, kind: str, message: str) -> None:
        """A fault that loses no series (a missing version label): logged once, not counted."""
        with self._lock:
            first = (source, kind) not in self._logged
            self._logged.add((source, kind))
        if first:
            log.warning("%s error (%s): %s [logged once]", source, kind, one_line(message))

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


MAX_LINE = 1000  # characters of one logged message: an engine's answer may repeat whatever it was sent


def one_line(text: str) -> str:
    """A message as one log line: a multi-line error text (an API's body, say) folded, a long one clipped."""
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_LINE else f"{line[:MAX_LINE]}... ({len(line)} characters)"
