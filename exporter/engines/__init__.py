"""The watched engines, one adapter module per kind (base.py has the interface), read in parallel."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from vramledger.exporter.engines.base import Engine, EngineInfo, EngineState, NotServing, Status, Wrong
from vramledger.exporter.engines.bounds import OutOfBounds, check_state
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.kinds import EngineKind
from vramledger.exporter.engines.lifecycle import Lifecycle, Reading
from vramledger.exporter.engines.registry import kind_named
from vramledger.exporter.engines.vllm import VllmEngine
from vramledger.exporter.engines.vramledger import VramledgerEngine
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.processes import PortLocator

__all__ = ["Engine", "EngineInfo", "EngineState", "Engines", "Reading", "Status", "VllmEngine",
           "VramledgerEngine", "base_url", "parse_engine_arg"]

log = logging.getLogger(__name__)
MAX_THREADS = 64  # one read in flight per engine at most; beyond this many engines reads queue


def base_url(url: str) -> str:
    """The server's base URL: an OpenAI API base (".../v1", as clients are configured) means its server."""
    return url.rstrip("/").removesuffix("/v1")


def parse_engine_arg(kind: EngineKind, text: str) -> tuple[str, int | None]:
    """A kind's flag's value: URL, or URL=PID where the kind takes a pid (for a server whose process the
    exporter cannot find by its port); the URL is its server's base URL."""
    url, sep, pid = text.rpartition("=")
    if not kind.takes_pid or not sep or "/" in pid or not pid.strip().isdigit():
        return base_url(text), None
    if int(pid) <= 0:
        raise ValueError(f"bad pid in {text!r}")
    return base_url(url), int(pid)


def read_one(engine: Engine) -> Reading:
    """engine.read() as a Reading, its values within bounds; an adapter's own fault, or a value beyond
    bounds, is a wrong reading, never raised."""
    try:
        state = engine.read()
        check_state(state)
        return Reading(Status.SERVING, state)
    except OutOfBounds as e:
        return Reading(Status.WRONG, reason=f"{engine.url}: {e}", counted=True)
    except NotServing as e:
        return Reading(e.status, reason=str(e), wrong_kind=isinstance(e, Wrong) and e.wrong_kind,
                       counted=e.counted)
    except Exception as e:  # noqa: BLE001 - one adapter's bug must not hide the other engines
        return Reading(Status.WRONG, reason=f"exporter fault reading {engine.url}: {type(e).__name__}: {e}",
                       counted=True)


@dataclass
class _Watch:
    engine: Engine
    lifecycle: Lifecycle
    pending: Future | None = None  # its read, still running from an earlier scrape


class EngineSet(Protocol):
    """What the collector and the CLI use of the watched engines (Engines, or DiscoveredEngines over it)."""

    sources: tuple[str, ...]  # the error sources their reads count in

    @property
    def urls(self) -> list[str]: ...

    def read(self) -> dict[str, Reading]: ...

    def close(self) -> None: ...


class Engines:
    """Every watched engine: read() asks them all at once and waits one timeout at most, so a scrape
    costs about the slowest engine's answer, whatever their number. Each engine's status is followed
    (one log line per change); only wrong answers count as errors."""

    def __init__(self, engines: list[Engine], errors: ErrorLog, client: HttpClient | None = None,
                 timeout: float = 1.0):
        urls = [e.url for e in engines]
        duplicates = sorted({url for url in urls if urls.count(url) > 1})
        if duplicates:
            raise ValueError(f"watched twice: {', '.join(duplicates)}")
        self._errors = errors
        self._client = client  # closed with the engines
        self.timeout = timeout
        self._watches: dict[str, _Watch] = {}
        self._aliases: dict[str, str] = {}  # URL -> the URL whose processes it reaches, left out meanwhile
        self._pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="engine-read")
        for engine in engines:
            self.add(engine)
        self.sources = tuple(dict.fromkeys(e.source for e in engines))

    @classmethod
    def open(cls, given: Mapping[str, list[str]], timeout: float, errors: ErrorLog) -> Engines:
        """The engines given on the command line: each kind's name -> its flag's values."""
        client = HttpClient(timeout)
        engines: list[Engine] = []
        for name, values in given.items():
            kind = kind_named(name)
            if kind is None:
                raise ValueError(f"no engine kind {name!r}")
            for url, pid in (parse_engine_arg(kind, text) for text in values):
                engines.append(kind.adapter(url, client, errors, None if pid is None else PortLocator(url, pid)))
        return cls(engines, errors, client, timeout)

    @property
    def urls(self) -> list[str]:
        return list(self._watches)

    @property
    def engines(self) -> list[Engine]:
        return [w.engine for w in self._watches.values()]

    def add(self, engine: Engine) -> None:
        """Watch one more engine (one the API lists, say)."""
        self._watches[engine.url] = _Watch(engine, Lifecycle(engine.kind, engine.url))

    def remove(self, url: str) -> None:
        watch = self._watches.pop(url, None)
        self._aliases.pop(url, None)
        if watch is not None:
            watch.engine.close()

    def read(self, wait_s: float | None = None) -> dict[str, Reading]:
        """Each engine's reading now, by URL, after waiting at most wait_s (default: the timeout)."""
        wait_s = self.timeout if wait_s is None else wait_s
        for watch in self._watches.values():
            if watch.pending is None:
                watch.pending = self._pool.submit(read_one, watch.engine)
        wait([w.pending for w in self._watches.values() if w.pending is not None], timeout=wait_s)
        readings: dict[str, Reading] = {}
        for url, watch in self._watches.items():
            if watch.pending is not None and watch.pending.done():
                readings[url], watch.pending = watch.pending.result(), None
            else:  # left running: the next scrape takes its answer rather than asking again
                readings[url] = Reading(Status.UNREACHABLE, reason=f"{url}: no answer within {wait_s:g} s")
        aliases = self._settle_claims(readings)
        for url, reading in readings.items():
            watch = self._watches[url]
            watch.lifecycle.update(reading)
            if reading.counted:
                self._errors.count(watch.engine.source)
        self._follow_aliases(aliases)
        return {url: reading for url, reading in readings.items() if url not in aliases}

    @staticmethod
    def _settle_claims(readings: dict[str, Reading]) -> dict[str, str]:
        """Gives each process to one engine, in this scrape; returns the aliases, URL -> the URL whose
        processes it reaches.

        Pids found behind an engine's port come first (in watching order), then pids only claimed. A
        claim of a process found behind another engine's port is refused: that engine is wrong. Two
        engines whose processes were both found there (127.0.0.1 and localhost), or were both only
        claimed, are one server under two URLs: the later is left out, and read again next scrape.
        """
        states = {url: r.state for url, r in readings.items() if r.state is not None}
        owner: dict[int, tuple[str, bool]] = {}  # pid -> (URL, only claimed)
        aliases: dict[str, str] = {}
        for url, state in sorted(states.items(), key=lambda item: item[1].claimed):  # stable: found first
            taken = [owner[pid] for pid in sorted(state.pids) if pid in owner]
            if not taken:
                owner.update(dict.fromkeys(state.pids, (url, state.claimed)))
            elif state.claimed and not taken[0][1]:
                readings[url] = Reading(Status.WRONG, counted=True, reason=(
                    f"{url}: claims pids {', '.join(map(str, sorted(state.pids)))}, found behind "
                    f"{taken[0][0]}'s port: refused"))
            else:
                aliases[url] = taken[0][0]
        return aliases

    def _follow_aliases(self, aliases: dict[str, str]) -> None:
        """One line when a URL becomes another's alias, one when it stops being one."""
        for url, first in aliases.items():
            if self._aliases.get(url) != first:
                log.warning("%s reaches the same processes as %s: watching that server once, as %s", url,
                            first, first)
        for url in self._aliases.keys() - aliases.keys():
            log.info("%s no longer reaches the processes of %s: watched again", url, self._aliases[url])
        self._aliases = aliases

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for watch in self._watches.values():
            watch.engine.close()
        if self._client is not None:
            self._client.close()
