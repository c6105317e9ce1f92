"""What the adapters of the engines found by their port share: their processes, the facts read once per
server run, their routes that may be off, and their lifecycle.

A server that stops answering is forgotten (its processes looked for again, its facts read again), so a
restart is no error: the next answer is the new server's. A server restarted between two scrapes is
another process tree, and its facts are read again too.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from vramledger.exporter.engines.base import EngineState, NotServing, Wrong
from vramledger.exporter.engines.bounds import OutOfBounds, shown
from vramledger.exporter.engines.fetch import HttpClient, Response, WrongStatus, fetch
from vramledger.exporter.engines.promtext import samples
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import Locator, NotFound, PortLocator

T = TypeVar("T")


class PortEngine:
    """One server of a kind, its processes found behind its port; subclasses read it in serving()."""
    kind = ""
    source = ""

    def __init__(self, url: str, client: HttpClient, errors: ErrorLog, locator: Locator | None = None):
        self.url = url.rstrip("/")
        self._client = client
        self._errors = errors
        self._locator = locator or PortLocator(self.url)
        self._tree: frozenset[int] | None = None  # the processes whose facts are kept
        self._facts: dict[str, object] = {}
        self._off: set[str] = set()  # routes this server run does not serve

    def read(self) -> EngineState:
        try:
            return self.serving()
        except NotServing:
            self.forget()
            raise

    def serving(self) -> EngineState:
        """The server now; raises NotServing."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def forget(self) -> None:
        """The server stopped answering: find its processes, read its facts and routes anew."""
        self._locator.forget()
        self._tree, self._facts, self._off = None, {}, set()

    def get(self, path: str) -> Response:
        """GET path of the server; raises NotServing."""
        return fetch(self._client, self.url + path)

    def json(self, path: str) -> object:
        """GET path as JSON; raises NotServing (Wrong where the answer is no JSON)."""
        try:
            return self.get(path).json()
        except ValueError as e:
            raise Wrong(f"{self.url}{path}: no JSON ({e})") from None

    def optional(self, path: str) -> Response | None:
        """GET a route the server serves only when told to (its /metrics); None, and not asked again this
        server run, where it answers an HTTP error instead."""
        if path in self._off:
            return None
        try:
            return self.get(path)
        except WrongStatus:
            self._off.add(path)
            return None

    def samples(self, response: Response, names: tuple[str, ...], path: str = "/metrics") -> list:
        """The named series of a Prometheus text; raises Wrong where a line of theirs is none."""
        try:
            return samples(response.content, names)
        except OutOfBounds:
            raise
        except ValueError as e:
            raise Wrong(f"{self.url}{path}: {e}") from None

    def fullest(self, series: str) -> float | None:
        """The largest value of a usage series on the server's /metrics (its fullest scheduler, the one
        that queues first), where the server serves /metrics; None where it does not."""
        metrics = self.optional("/metrics")
        if metrics is None:
            return None
        return max((s.value for s in self.samples(metrics, (series,))), default=None)

    def pids(self) -> frozenset[int]:
        """Its processes behind its port; frozenset() where none can be seen (counted once per cause)."""
        try:
            pids = self._locator.pids()
        except NotFound as e:  # its hint names this kind's flag (each is --<kind>), not vLLM's
            hint = f"; give its pid (--{self.kind} URL=PID)" if str(e) != e.reason else ""
            self._errors.record(self.source, f"no_process {self.url}", f"{self.url}: {e.reason}{hint}")
            pids = frozenset()
        except ValueError as e:
            self._errors.record(self.source, f"no_process {self.url}", f"{self.url}: {e}")
            pids = frozenset()
        if pids != self._tree:  # another server run, or a process come or gone: read its facts and routes again
            self._tree, self._facts, self._off = pids, {}, set()
        return pids

    def fact(self, name: str, read: Callable[[], T]) -> T:
        """A fact of this server run (its version), read once per process tree: call after pids()."""
        if name not in self._facts:
            self._facts[name] = read()
        return self._facts[name]  # type: ignore[return-value]

    def noted_version(self, read: Callable[[], str]) -> str:
        """Its version, once per process tree; "" (noted, not counted: only a label is lost) where it
        cannot be read."""
        def version() -> str:
            try:
                return read()
            except (NotServing, ValueError, AttributeError, TypeError) as e:
                self._errors.note(self.source, f"no_version {self.url}", f"{self.url}: no version: {e}")
                return ""
        return self.fact("version", version)


def field(doc: object, key: str, kind: type | tuple[type, ...], where: str, optional: bool = False):
    """doc[key] of the given type (bool is no int here); raises ValueError naming what is wrong."""
    value = doc.get(key) if isinstance(doc, dict) else None
    if value is None and optional:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        value = None
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key} {shown(value)} is no {getattr(kind, '__name__', kind)}")
    return value
