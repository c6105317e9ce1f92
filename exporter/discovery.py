"""--kubernetes: the engines of this node, found through the API before each scrape.

It answers like exporter.engines.Engines (urls, sources, read(), close()), but its members change:
a pod that appears gets an adapter, one that goes away loses it. A vLLM server's processes are the
processes of its pod (their cgroups name it): the exporter cannot see a socket in the pod's network
namespace, so finding them by port would fail.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from exporter.cgroups import pids_in_pod
from exporter.engines import Engine, Engines, EngineState, VllmEngine, VramledgerEngine, read_guarded
from exporter.engines.vllm import SOURCE as VLLM_SOURCE
from exporter.engines.vramledger import SOURCE as WORKER_SOURCE
from exporter.errors import ErrorLog
from exporter.kubernetes import Engine as FoundEngine
from exporter.kubernetes import SOURCE as KUBERNETES_SOURCE
from exporter.kubernetes import PodDirectory
from exporter.processes import NotFound


class PodLocator:
    """The processes of one pod, by their cgroups (exporter.processes.Locator)."""

    def __init__(self, pod_uid: str, name: str, proc_root: str | Path = "/proc"):
        self.pod_uid, self.name, self._proc_root = pod_uid, name, proc_root

    def pids(self) -> frozenset[int]:
        found = pids_in_pod(self.pod_uid, self._proc_root)
        if not found:
            raise NotFound(f"no process of pod {self.name} is visible (is the exporter in the host pid "
                           "namespace?)")
        return found

    def forget(self) -> None:
        pass  # nothing cached


class DiscoveredEngines:
    """The --worker / --vllm engines given, plus those the API lists on this node, read in parallel."""

    def __init__(self, pods: PodDirectory, given: Engines, timeout: float, errors: ErrorLog):
        self._pods = pods
        self._given = given
        self._errors = errors
        # trust_env=False: a proxy from the environment must not sit between the exporter and its engines.
        self._client = httpx.Client(timeout=timeout, trust_env=False)
        self._found: dict[str, tuple[str, Engine]] = {}  # URL -> (pod UID, adapter), while listed
        self._pool = ThreadPoolExecutor(16)
        self.urls: list[str] = list(given.urls)
        self.sources = tuple(dict.fromkeys((*given.sources, WORKER_SOURCE, VLLM_SOURCE, KUBERNETES_SOURCE)))

    def read(self) -> dict[str, EngineState | None]:
        self._update(self._pods.engines())
        engines = [*self._given.engines, *(adapter for _, adapter in self._found.values())]
        return dict(zip(self.urls, self._pool.map(self._read_one, engines)))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for _, engine in self._found.values():
            engine.close()
        self._given.close()
        self._client.close()

    def _update(self, listed: list[FoundEngine]) -> None:
        wanted = {e.url: e for e in listed if e.url not in self._given.urls}
        for url, (uid, _) in list(self._found.items()):
            if url not in wanted or wanted[url].uid != uid:  # its pod went away (or another took its IP)
                self._found.pop(url)[1].close()
        for url, found in wanted.items():
            if url not in self._found:
                self._found[url] = (found.uid, self._adapter(found))
        self.urls = [*self._given.urls, *self._found]

    def _adapter(self, found: FoundEngine) -> Engine:
        if found.kind == "vllm":
            return VllmEngine(found.url, self._client, self._errors,
                              PodLocator(found.uid, f"{found.namespace}/{found.pod}"))
        return VramledgerEngine(found.url, self._client, self._errors)

    def _read_one(self, engine: Engine) -> EngineState | None:
        return read_guarded(engine, self._errors)
