"""Error accounting for the exporter: every error counted, each kind logged once."""
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
        with self._lock:
            self._counts[source] = self._counts.get(source, 0) + 1
        self.note(source, kind, message)

    def note(self, source: str, kind: str, message: str) -> None:
        """A fault another metric already reports (a worker down: vramledger_worker_up 0): logged once."""
        with self._lock:
            first = (source, kind) not in self._logged
            self._logged.add((source, kind))
        if first:
            log.warning("%s error (%s): %s [logged once]", source, kind, message)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
