"""The watched engines, one adapter module per kind (base.py has the interface), read in parallel."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from exporter.engines.base import Engine, EngineInfo, EngineState
from exporter.engines.vllm import VllmEngine
from exporter.engines.vramledger import VramledgerEngine
from exporter.errors import ErrorLog
from exporter.processes import PortLocator

__all__ = ["Engine", "EngineInfo", "EngineState", "Engines", "VllmEngine", "VramledgerEngine",
           "parse_vllm_arg"]


def parse_vllm_arg(text: str) -> tuple[str, int | None]:
    """--vllm URL, or URL=PID when the exporter cannot find the server's process by its port."""
    url, sep, pid = text.rpartition("=")
    if not sep or "/" in pid or not pid.strip().isdigit():
        return text.rstrip("/"), None
    if int(pid) <= 0:
        raise ValueError(f"bad pid in {text!r}")
    return url.rstrip("/"), int(pid)


def read_guarded(engine: Engine, errors: ErrorLog) -> EngineState | None:
    """engine.read(), with any fault counted under its source rather than raised."""
    try:
        return engine.read()
    except Exception as e:  # noqa: BLE001 - one adapter's bug must not hide the other engines
        errors.record(engine.source, type(e).__name__, f"{engine.url}: {type(e).__name__}: {e}")
        return None


class Engines:
    """Every watched engine; read() asks them all at once, so one slow server costs one timeout."""

    def __init__(self, engines: list[Engine], errors: ErrorLog, client: httpx.Client | None = None):
        urls = [e.url for e in engines]
        duplicates = sorted({url for url in urls if urls.count(url) > 1})
        if duplicates:
            raise ValueError(f"watched twice: {', '.join(duplicates)}")
        self.engines = engines
        self.urls = urls
        self.sources = tuple(dict.fromkeys(e.source for e in engines))
        self._errors = errors
        self._client = client  # closed with the engines
        self._pool = ThreadPoolExecutor(min(len(engines), 16)) if len(engines) > 1 else None

    @classmethod
    def open(cls, workers: list[str], vllms: list[str], timeout: float, errors: ErrorLog) -> Engines:
        # trust_env=False: a proxy from the environment must not sit between the exporter and its engines.
        client = httpx.Client(timeout=timeout, trust_env=False)
        engines: list[Engine] = [VramledgerEngine(url, client, errors) for url in workers]
        for url, pid in map(parse_vllm_arg, vllms):
            engines.append(VllmEngine(url, client, errors, PortLocator(url, pid)))
        return cls(engines, errors, client)

    def read(self) -> dict[str, EngineState | None]:
        """Each engine's state now, by URL; None for those down or unreadable."""
        states = map(self._read_one, self.engines) if self._pool is None else self._pool.map(
            self._read_one, self.engines)
        return dict(zip(self.urls, states))

    def _read_one(self, engine: Engine) -> EngineState | None:
        return read_guarded(engine, self._errors)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for engine in self.engines:
            engine.close()
        if self._client is not None:
            self._client.close()
